"""Limits on every count and size in a batch, checked before a consumer applies it.

A batch within the Avro schema can still be absurd (an ``attention_dp_size`` of 2^22, negative
ranks, a million windows): :class:`BatchLimits` bounds what one message may ask of a consumer,
and :func:`check_batch` raises :class:`LimitError` (a :class:`DecodeError`) naming the first
field beyond them. Both index cores apply the same rules (the compiled one in C, on the flat
batch); ``avro/README.md`` documents them. ``max_caches``, ``max_instances`` and ``max_workers`` bound
an index over time, not one message: a batch that would take an index past one raises
:class:`IndexFullError`.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass

from .errors import LimitError
from .model import EventBatch, KVCacheCreatedData, KVCacheRemovedData, KVCacheStoredData, KVCacheUpdatedData

__all__ = [
    "DEFAULT_LIMITS",
    "LEVEL_MAX",
    "MAX_CACHES",
    "BatchLimits",
    "IndexFullError",
    "LimitError",
    "check_batch",
    "check_no_bools",
    "check_worker_windows",
    "index_full",
    "instances_full",
    "worker_windows_full",
    "workers_full",
]

LEVEL_MAX = 15
"""The highest cache level a consumer keeps apart (higher ones count as this one)."""
MAX_CACHES = 1 << 20
"""The most (worker, window size) caches an index can number (20 bits, ``consumer/_state.py``)."""


class IndexFullError(LimitError):
    """A valid batch that would take the index past ``BatchLimits.max_caches``, ``max_instances``
    or ``max_workers``; rejected whole."""


@dataclass(frozen=True, slots=True)
class BatchLimits:
    """The configurable limits (defaults well above what engines send); the fixed rules are in
    ``avro/README.md``."""

    max_attention_dp_size: int = 1024
    """Attention data-parallel ranks of one instance: workers one message may create."""
    max_events: int = 1 << 20
    """Events in one batch."""
    max_blocks_per_event: int = 1 << 16
    """Blocks of one Stored event, hashes of one Removed event."""
    max_tokens_per_block: int = 4096
    """Tokens of one stored block (the engine's block size)."""
    max_window_size: int = 1 << 24
    """An attention window, in tokens."""
    max_windows_per_batch: int = 16
    """Distinct window sizes in one batch (each is a cache per worker)."""
    max_cache_levels: int = LEVEL_MAX + 1
    """Entries of a Created event's ``num_blocks_per_cache_level``."""
    max_mm_keys_per_block: int = 256
    """Multimodal keys of one block."""
    max_instance_id_bytes: int = 256
    """UTF-8 bytes of ``instance_id``."""
    max_cache_salt_bytes: int = 1024
    """UTF-8 bytes of a block's ``cache_salt``."""
    max_caches: int = MAX_CACHES
    """(worker, window size) caches one index keeps over its life, not per batch: every pair a
    Stored or Created event ever named takes one. A batch that could add more is rejected whole."""

    max_windows_per_worker: int = 64
    """Window sizes one worker keeps caches for over its life (every one a Stored or Created
    event of it ever named, as ``max_caches``): engines use one to three; each more costs every
    later event of the worker a step. A batch that could give a worker more is rejected whole."""
    max_instances: int = MAX_CACHES
    """Instance ids one index keeps over its life: every batch's ``instance_id`` takes one, an
    empty batch's too (27 bytes on the topic cost ~400 bytes of memory and of every checkpoint).
    A batch naming a new one past it is rejected whole."""
    max_workers: int = MAX_CACHES
    """(instance, rank) workers one index keeps over its life: every rank an event or a
    ``dropped`` count names takes one. A batch that could add more is rejected whole."""

    def __post_init__(self) -> None:
        for name in self.__slots__:
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"BatchLimits.{name} must be a positive integer, got {value!r}")
        if self.max_cache_levels > LEVEL_MAX + 1:
            raise ValueError(f"BatchLimits.max_cache_levels is at most {LEVEL_MAX + 1}")
        if self.max_attention_dp_size > 1 << 20 or self.max_windows_per_batch > 1 << 16:
            raise ValueError("BatchLimits: max_attention_dp_size <= 2^20 and max_windows_per_batch <= 2^16")
        if self.max_caches > MAX_CACHES:
            raise ValueError(f"BatchLimits.max_caches is at most {MAX_CACHES} (2^20)")


DEFAULT_LIMITS = BatchLimits()
_I32 = (1 << 31) - 1
_I64 = (1 << 63) - 1
_U64 = (1 << 64) - 1


def _utf8_size(value: str, what: str) -> int:
    try:
        return len(value.encode("utf-8"))
    except UnicodeEncodeError as exc:
        raise LimitError(f"{what}: not valid UTF-8 ({exc.reason})") from None


def _at_most(value: int, top: int, what: str, name: str) -> None:
    if value > top:
        raise LimitError(f"{what}: {value} is over the limit {top} (BatchLimits.{name})")


def _non_negative(value: int, what: str, top: int = _I64) -> None:
    if value < 0:
        raise LimitError(f"{what}: {value} is negative")
    if value > top:
        raise LimitError(f"{what}: {value} is outside the schema's range")


def check_no_bools(batch: EventBatch) -> None:
    """LimitError for a bool where ``batch`` (model objects: the wire has no bools) has an int
    that an index keeps as it is: its session numbers, an event's id, window size and rank, a
    Created event's capacities, a drop count. ``True`` is an ``int`` to Python, but a state
    holding one is not an index state (both cores refuse it alike)."""
    for name in ("producer_id", "sequence", "attention_dp_size"):
        _not_bool(getattr(batch, name), name)
    for i, drops in enumerate(batch.dropped):
        _not_bool(drops.attention_dp_rank, f"dropped[{i}].attention_dp_rank")
        _not_bool(drops.dropped_events, f"dropped[{i}].dropped_events")
    for i, event in enumerate(batch.events):
        _not_bool(event.event_id, f"events[{i}].event_id")
        _not_bool(event.window_size, f"events[{i}].window_size")
        _not_bool(event.attention_dp_rank, f"events[{i}].attention_dp_rank")
        if isinstance(event.data, KVCacheCreatedData):
            for k, blocks in enumerate(event.data.num_blocks_per_cache_level):
                _not_bool(blocks, f"events[{i}].data.num_blocks_per_cache_level[{k}]")


def _not_bool(value: object, what: str) -> None:
    if value.__class__ is bool:
        raise LimitError(f"{what}: {value!r} is a bool, where the schema has an int")


def _fits(value: int, low: int, high: int, what: str) -> None:
    """A value of a model object (not read from bytes) within its Avro type."""
    if not low <= value <= high:
        raise LimitError(f"{what}: {value} is outside the schema's range {low}..{high}")


def _check_stored(data: KVCacheStoredData, where: str, limits: BatchLimits) -> None:
    _at_most(len(data.blocks), limits.max_blocks_per_event, f"{where}.blocks", "max_blocks_per_event")
    for j, b in enumerate(data.blocks):
        at = f"{where}.blocks[{j}]"
        _fits(b.block_hash, 0, _U64, f"{at}.block_hash")
        if b.lora_id is not None:
            _fits(b.lora_id, 0, _U64, f"{at}.lora_id")
        for k, (_, offset) in enumerate(b.mm_keys):
            _fits(offset, -_I32 - 1, _I32, f"{at}.mm_keys[{k}].start_offset")
        n = len(b.tokens)
        _at_most(n, limits.max_tokens_per_block, f"{at}.tokens", "max_tokens_per_block")
        if b.token_extra_ids is not None and len(b.token_extra_ids) != n:
            raise LimitError(f"{at}.token_extra_ids: {len(b.token_extra_ids)} ids for {n} tokens")
        _fits(b.cache_level, -_I32 - 1, _I32, f"{at}.cache_level")  # saturated by the index
        _fits(b.priority, -_I32 - 1, _I32, f"{at}.priority")
        _at_most(len(b.mm_keys), limits.max_mm_keys_per_block, f"{at}.mm_keys", "max_mm_keys_per_block")
        if b.cache_salt is not None:
            size = _utf8_size(b.cache_salt, f"{at}.cache_salt")
            _at_most(size, limits.max_cache_salt_bytes, f"{at}.cache_salt bytes", "max_cache_salt_bytes")


def _check_data(data: object, where: str, limits: BatchLimits) -> None:
    if isinstance(data, KVCacheStoredData):
        if data.parent_hash is not None:
            _fits(data.parent_hash, 0, _U64, f"{where}.parent_hash")
        _check_stored(data, where, limits)
    elif isinstance(data, KVCacheRemovedData):
        n = len(data.block_hashes)
        _at_most(n, limits.max_blocks_per_event, f"{where}.block_hashes", "max_blocks_per_event")
        for k, h in enumerate(data.block_hashes):
            _fits(h, 0, _U64, f"{where}.block_hashes[{k}]")
    elif isinstance(data, KVCacheUpdatedData):
        _fits(data.block_hash, 0, _U64, f"{where}.block_hash")
        if data.cache_level is not None:
            _fits(data.cache_level.new_value, -_I32 - 1, _I32, f"{where}.cache_level.new_value")
        if data.priority is not None:
            _fits(data.priority.new_value, -_I32 - 1, _I32, f"{where}.priority.new_value")
    elif isinstance(data, KVCacheCreatedData):
        levels = data.num_blocks_per_cache_level
        _at_most(
            len(levels), limits.max_cache_levels, f"{where}.num_blocks_per_cache_level", "max_cache_levels"
        )
        for k, blocks in enumerate(levels):
            _non_negative(blocks, f"{where}.num_blocks_per_cache_level[{k}]", _I32)


def check_batch(batch: EventBatch, limits: BatchLimits = DEFAULT_LIMITS) -> None:
    """Raise :class:`LimitError` naming the first count or size of ``batch`` beyond ``limits``
    or the fixed rules (see ``avro/README.md``)."""
    size = _utf8_size(batch.instance_id, "instance_id")
    _at_most(size, limits.max_instance_id_bytes, "instance_id bytes", "max_instance_id_bytes")
    dp = batch.attention_dp_size
    if dp < 1:
        raise LimitError(f"attention_dp_size: {dp} is below 1")
    _at_most(dp, limits.max_attention_dp_size, "attention_dp_size", "max_attention_dp_size")
    _fits(batch.producer_id, -_I64 - 1, _I64, "producer_id")
    _non_negative(batch.sequence, "sequence")
    _non_negative(batch.first_event_block_offset, "first_event_block_offset", _I32)
    _at_most(len(batch.dropped), dp, "dropped (entries)", "max_attention_dp_size (one per rank)")
    for i, drops in enumerate(batch.dropped):
        if not 0 <= drops.attention_dp_rank < dp:
            raise LimitError(
                f"dropped[{i}].attention_dp_rank: {drops.attention_dp_rank} is not in 0..{dp - 1}"
            )
        _non_negative(drops.dropped_events, f"dropped[{i}].dropped_events")
    _at_most(len(batch.events), limits.max_events, "events", "max_events")
    check_no_bools(batch)
    windows: set[int] = set()
    for i, event in enumerate(batch.events):
        where = f"events[{i}]"
        _non_negative(event.event_id, f"{where}.event_id")
        rank = event.attention_dp_rank
        if rank is not None and not 0 <= rank < dp:
            raise LimitError(f"{where}.attention_dp_rank: {rank} is not in 0..{dp - 1}")
        window = event.window_size
        if window < 0:  # 0: the engine did not say (vLLM/SGLang full attention, the bridge's default)
            raise LimitError(f"{where}.window_size: {window} is negative")
        _at_most(window, limits.max_window_size, f"{where}.window_size", "max_window_size")
        windows.add(window)
        _at_most(
            len(windows),
            limits.max_windows_per_batch,
            f"{where}: distinct window sizes",
            "max_windows_per_batch",
        )
        _check_data(event.data, f"{where}.data", limits)


def instances_full(held: int, limits: BatchLimits) -> IndexFullError:
    """The error for a batch naming a new instance id in an index holding ``held`` of them."""
    return IndexFullError(
        f"index full: the batch names a new instance id, {held} held, the limit "
        f"{limits.max_instances} (BatchLimits.max_instances); nothing of it was applied"
    )


def workers_full(held: int, adding: int, limits: BatchLimits) -> IndexFullError:
    """The error for a batch that would add ``adding`` workers to an index holding ``held``."""
    return IndexFullError(
        f"index full: the batch would add {adding} (instance, rank) workers to the {held} held, "
        f"over the limit {limits.max_workers} (BatchLimits.max_workers); nothing of it was applied"
    )


def worker_windows_full(
    instance_id: str, rank: int, held: int, adding: int, limits: BatchLimits
) -> IndexFullError:
    """The error for a batch that would give worker ``(instance_id, rank)``, with caches for
    ``held`` window sizes, ``adding`` more."""
    return IndexFullError(
        f"index full: the batch would give worker {instance_id!r} rank {rank} {adding} more window "
        f"sizes to the {held} it has, over the limit {limits.max_windows_per_worker} "
        f"(BatchLimits.max_windows_per_worker); nothing of it was applied"
    )


def check_worker_windows(
    instance_id: str,
    caches: Iterable[tuple[int, int]],
    windows_of: Callable[[int], Collection[int]],
    limits: BatchLimits,
) -> None:
    """IndexFullError unless the ``(rank, window size)`` caches a batch's Stored and Created
    events name (``caches``) leave every worker of ``instance_id`` within
    ``limits.max_windows_per_worker``; ``windows_of(rank)``: the window sizes it has caches for
    (both cores; the lowest offending rank is named)."""
    known: dict[int, Collection[int]] = {}
    new: dict[int, set[int]] = {}
    for rank, window in caches:
        windows = known.get(rank)
        if windows is None:
            windows = known[rank] = windows_of(rank)
        if window not in windows:
            new.setdefault(rank, set()).add(window)
    for rank in sorted(new):
        if len(known[rank]) + len(new[rank]) > limits.max_windows_per_worker:
            raise worker_windows_full(instance_id, rank, len(known[rank]), len(new[rank]), limits)


def index_full(held: int, adding: int, limits: BatchLimits) -> IndexFullError:
    """The error for a batch that would add ``adding`` caches to an index holding ``held``."""
    return IndexFullError(
        f"index full: the batch would add {adding} (worker, window size) caches to the {held} held, "
        f"over the limit {limits.max_caches} (BatchLimits.max_caches); nothing of it was applied"
    )
