"""The global KV-cache index: which worker holds which blocks, rebuilt from kvevents batches.

:class:`CacheIndex` applies batches (sessions, replays, gaps, Created generations, snapshots,
Stored/Removed/Updated) and answers ``find_matches``: per worker, how many leading blocks of a
query it holds. The rules, matching, the two cores and threads: ``docs/INDEX.md`` (compiled core:
one writer thread and any number of reader threads; the pure core: not thread-safe).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, NamedTuple

import msgspec
from kvevents.schemas import BatchLimits, EventBatch, KVCacheStoredData, MmKey
from kvevents.schemas.codec import pure_python_forced

from ._pycore import COUNTER_NAMES, PyIndexCore
from ._state import LEVEL_MAX, decode_state, encode_state
from ._twins import IndexCoreApi, compiled_core_factory
from .workers import BlockEntry, WindowStats, WorkerKey, WorkerStats

__all__ = ["CacheIndex", "IndexStats", "Match", "compiled_core_available"]

log = logging.getLogger(__name__)

_CompiledCore = compiled_core_factory()


def compiled_core_available() -> bool:
    """Whether the compiled core (``kvevents.consumer._indexcore``) is built."""
    return _CompiledCore is not None


class Match(NamedTuple):
    """A worker's contiguous run of matched blocks and how many of them are at level 0."""

    blocks: int
    primary_blocks: int

    @property
    def secondary_blocks(self) -> int:
        """Blocks of the run held at a level above 0 (offloaded)."""
        return self.blocks - self.primary_blocks

    def score(self, secondary_weight: float) -> float:
        """``primary_blocks + secondary_weight * secondary_blocks``."""
        return self.primary_blocks + secondary_weight * (self.blocks - self.primary_blocks)


class IndexStats(msgspec.Struct, frozen=True):
    """Index-wide figures: counters since construction (or restore) and current sizes."""

    counters: dict[str, int]
    workers: int
    degraded_workers: int
    held_blocks: int
    """Worker-block pairs (a block held by k window caches counts k times)."""
    distinct_blocks: int
    memory_bytes: int


def _make_core(core: str, limits: BatchLimits | None = None) -> IndexCoreApi:
    if core not in ("auto", "compiled", "python"):
        raise ValueError(f"core must be 'auto', 'compiled' or 'python', got {core!r}")
    if core == "python" or (core == "auto" and pure_python_forced()):
        return PyIndexCore(WorkerKey, limits)
    if _CompiledCore is None:
        if core == "compiled":
            raise RuntimeError(
                "the compiled index core kvevents.consumer._indexcore is not built "
                "(pip install -e . with Cython and a C compiler)"
            )
        log.debug("kvevents.consumer._indexcore is not built; using the pure-Python core")
        return PyIndexCore(WorkerKey, limits)
    return _CompiledCore(WorkerKey, limits)


class CacheIndex:
    """Global prefix-cache index of every worker's KV blocks (rules in ``docs/INDEX.md``).

    ``core``: "auto" (the compiled core when built, unless ``KVEVENTS_PURE_PYTHON`` is set),
    "compiled" or "python". Both cores give identical results. ``limits``: what one batch may
    ask of the index (:class:`kvevents.schemas.BatchLimits`; defaults otherwise); a batch
    beyond them raises :class:`kvevents.schemas.LimitError` and changes nothing.
    """

    def __init__(self, *, core: str = "auto", limits: BatchLimits | None = None) -> None:
        self._core = _make_core(core, limits)
        if self._core.compiled and type(self).find_matches is CacheIndex.find_matches:
            # the compiled core's own find_matches (same signature and answers), bound on the
            # instance: a lookup then runs no Python frame of this class's (docs/INDEX.md)
            compiled: Any = self._core
            self.__dict__["find_matches"] = compiled.find_matches
            if type(self).find_matches_by_content is CacheIndex.find_matches_by_content:
                self.__dict__["find_matches_by_content"] = compiled.find_matches_by_content

    @property
    def limits(self) -> BatchLimits:
        """The limits this index applies to every batch."""
        return self._core.limits

    @property
    def compiled(self) -> bool:
        """Whether this index runs on the compiled core."""
        return bool(self._core.compiled)

    # ------------------------------------------------------------------ applying

    def apply(self, batch: EventBatch) -> None:
        """Apply one batch of events (every rule is in ``docs/INDEX.md``)."""
        self._core.apply_batch(batch)

    def apply_encoded(self, data: bytes | bytearray | memoryview) -> None:
        """Decode one single-object encoded batch and apply it; the compiled core reads the
        Avro body directly into the index. Malformed bytes, and batches beyond the limits, raise
        :class:`kvevents.schemas.DecodeError` and change nothing."""
        self._core.apply_encoded(data)

    def apply_encoded_many(self, batches: Sequence[bytes | bytearray | memoryview]) -> int:
        """:meth:`apply_encoded` on each of ``batches`` in order, in one call (no Python call per
        batch). Stops at the first that raises (its note names the batch): the ones before it
        stay applied, the rest are not, so a caller that sets bad batches aside resumes after
        it. Returns how many were applied."""
        return int(self._core.apply_encoded_many(batches))

    # ------------------------------------------------------------------ matching

    def find_matches(
        self,
        block_hashes: Sequence[int],
        window_size: int | None = None,
        *,
        max_cache_level: int | None = None,
    ) -> dict[WorkerKey, int]:
        """Per worker, how many leading blocks of ``block_hashes`` (engine hashes) it holds
        contiguously from the first; workers with none are omitted.

        ``window_size`` restricts to that window size's caches (None: each worker's best).
        ``max_cache_level=0`` stops a worker's run at a block it holds only at a higher level.
        An ``array('Q')`` of hashes is read without conversion. A hash the walk reaches that is
        not an int in 0..2**64-1 raises ``ValueError`` (``TypeError`` for a non-int) naming its
        position; hashes after the query stops matching are not read.
        """
        return self._core.match_counts(block_hashes, False, window_size, _max_level(max_cache_level))

    def find_matches_by_content(
        self,
        content_hashes: Sequence[int],
        window_size: int | None = None,
        *,
        max_cache_level: int | None = None,
    ) -> dict[WorkerKey, int]:
        """:meth:`find_matches` on content hashes (from :meth:`content_hashes`)."""
        return self._core.match_counts(content_hashes, True, window_size, _max_level(max_cache_level))

    def find_matches_for_tokens(
        self,
        tokens: Sequence[int],
        block_size: int,
        lora_id: int | None = None,
        *,
        window_size: int | None = None,
        max_cache_level: int | None = None,
        cache_salt: str | None = None,
        token_extra_ids: Sequence[int] | None = None,
        mm_keys: Sequence[Sequence[MmKey]] | None = None,
    ) -> dict[WorkerKey, int]:
        """Per worker, how many leading full blocks of ``tokens`` it holds, by content.

        The query's blocks must be described as the engine described the stored ones:
        the same ``block_size``, LoRA id, cache salt (it applies to the first block), and
        per-token extra ids / per-block multimodal keys when the engine reported them.
        """
        hashes = self.content_hashes(
            tokens,
            block_size,
            lora_id,
            cache_salt=cache_salt,
            token_extra_ids=token_extra_ids,
            mm_keys=mm_keys,
        )
        return self._core.match_counts(hashes, True, window_size, _max_level(max_cache_level))

    def match_details(
        self,
        hashes: Sequence[int],
        *,
        by_content: bool = False,
        window_size: int | None = None,
        max_cache_level: int | None = None,
    ) -> dict[WorkerKey, Match]:
        """Per worker, its best contiguous run (blocks, of which at level 0)."""
        best: dict[WorkerKey, Match] = {}
        slot_workers: list[WorkerKey] = self.__dict__.get("_slot_workers", [])
        known = len(slot_workers)
        for slot, run, primary in self._core.match(
            hashes, by_content, window_size, _max_level(max_cache_level)
        ):
            key = slot_workers[slot] if slot < known else self._slot_worker(slot)
            old = best.get(key)
            if old is None or (run, primary) > old:
                best[key] = Match(run, primary)
        return best

    def weighted_matches(
        self,
        hashes: Sequence[int],
        *,
        secondary_weight: float = 0.5,
        by_content: bool = False,
        window_size: int | None = None,
    ) -> dict[WorkerKey, float]:
        """Per worker, its contiguous run scored ``primary + secondary_weight * secondary``.

        A secondary-level (offloaded) block still continues the run (the engine can onboard
        it), but is worth ``secondary_weight`` of a primary block.
        """
        if not 0.0 <= secondary_weight <= 1.0:
            raise ValueError(f"secondary_weight must be within 0..1, got {secondary_weight}")
        best: dict[WorkerKey, float] = {}
        for slot, run, primary in self._core.match(hashes, by_content, window_size, LEVEL_MAX):
            key = self._slot_worker(slot)
            score = primary + secondary_weight * (run - primary)
            if score > best.get(key, 0.0):
                best[key] = score
        return best

    def content_hashes(
        self,
        tokens: Sequence[int],
        block_size: int,
        lora_id: int | None = None,
        *,
        cache_salt: str | None = None,
        token_extra_ids: Sequence[int] | None = None,
        mm_keys: Sequence[Sequence[MmKey]] | None = None,
    ) -> list[int]:
        """The chained content hashes of the full blocks of ``tokens`` (see ``hashing``);
        ValueError for a LoRA id, extra id or multimodal offset no stored block can carry."""
        return self._core.content_hashes(tokens, block_size, lora_id, cache_salt, token_extra_ids, mm_keys)

    def _slot_worker(self, slot: int) -> WorkerKey:
        """The worker of a cache slot, from a table kept on the instance: both cores only
        append slots and a slot keeps its worker (``import_state`` runs on a fresh index only)."""
        slot_workers: list[WorkerKey] = self.__dict__.setdefault("_slot_workers", [])
        for known in range(len(slot_workers), slot + 1):
            instance_id, rank, _ = self._core.slot_key(known)
            slot_workers.append(WorkerKey(instance_id, rank))
        return slot_workers[slot]

    # ------------------------------------------------------------------ introspection

    def workers(self) -> list[WorkerKey]:
        """Every worker the index has seen, sorted."""
        return [WorkerKey(i, r) for i, r in self._core.workers()]

    def degraded_workers(self) -> list[WorkerKey]:
        """Workers whose view may be incomplete, sorted (one pass, no record per worker)."""
        return sorted(WorkerKey(i, r) for i, r in self._core.degraded_workers())

    def worker_count(self) -> int:
        """How many workers the index has seen (``len(workers())`` without listing them)."""
        return self._core.worker_count()

    def instances(self) -> list[str]:
        """Every instance id the index has seen, sorted."""
        return sorted(self._core.instance_ids())

    def workers_of(self, instance_ids: Iterable[str]) -> list[WorkerKey]:
        """The workers of the given instances (ids the index has not seen: none), sorted."""
        return sorted(WorkerKey(i, r) for i, r in self._core.instance_workers(instance_ids))

    def is_degraded(self, key: WorkerKey) -> bool:
        """Whether ``key``'s view may be incomplete (KeyError for an unknown worker)."""
        return bool(self._info(key)["gaps"])

    def _info(self, key: WorkerKey) -> dict[str, Any]:
        info = self._core.worker_info(key[0], key[1])
        if info is None:
            raise KeyError(f"unknown worker {key!r}")
        return info

    def worker_stats(self, key: WorkerKey) -> WorkerStats:
        """Blocks per window size and cache level, degraded flag and reasons, cursor, session."""
        info = self._info(key)
        windows = {
            window: WindowStats(window, sum(levels.values()), levels, capacity)
            for window, (levels, capacity) in info["windows"].items()
        }
        reasons = info["reasons"]
        if info["gaps"] > len(reasons):
            reasons = (*reasons, f"... {info['gaps'] - len(reasons)} more")
        return WorkerStats(
            key=WorkerKey(*key),
            degraded=bool(info["gaps"]),
            degraded_reasons=reasons,
            last_event_id=info["cursor"],
            producer_id=info["producer_id"],
            last_batch_sequence=info["sequence"],
            windows=windows,
        )

    def worker_blocks(self, key: WorkerKey, window_size: int) -> list[BlockEntry]:
        """Every block ``key`` holds in its ``window_size`` cache, sorted by engine hash.

        Walks the whole index (for tests, snapshots and debugging, not for the hot path).
        """
        return [BlockEntry(*b) for b in self._core.worker_blocks(key[0], key[1], window_size)]

    def stats(self) -> IndexStats:
        """Counters and sizes of the whole index."""
        return IndexStats(
            counters=self._core.counters(),
            workers=self.worker_count(),
            degraded_workers=len(self._core.degraded_workers()),
            held_blocks=self._core.held_blocks(),
            distinct_blocks=self._core.node_count(),
            memory_bytes=self._core.memory_bytes(),
        )

    def counters(self) -> dict[str, int]:
        """The counters of :meth:`stats` alone (cheap: no walk over workers)."""
        return dict(self._core.counters())

    def held_blocks(self) -> int:
        """Worker-block pairs held (a block held by k window caches counts k times)."""
        return int(self._core.held_blocks())

    def memory_bytes(self) -> int:
        """Estimated bytes the index uses (exact for the compiled core's C tables)."""
        return int(self._core.memory_bytes())

    # ------------------------------------------------------------------ seams for snapshots

    def reset_worker(self, key: WorkerKey, *, clear_degraded: bool = False) -> None:
        """Drop every window and block of ``key`` (its cursor stays). ``clear_degraded`` also
        clears its degraded flag; otherwise it stays as it was."""
        self._core.reset_worker(key[0], key[1], clear_degraded)

    def reset_workers(self, keys: Iterable[WorkerKey], *, clear_degraded: bool = False) -> None:
        """:meth:`reset_worker` for each of ``keys`` (an instance's ranks, say); the compiled
        core finds all their blocks in one pass over the index instead of one per worker."""
        self._core.reset_workers([(key[0], key[1]) for key in keys], clear_degraded)

    def mark_degraded(self, key: WorkerKey, reason: str) -> None:
        """Flag ``key`` as incomplete (e.g. a reader that skipped a malformed message)."""
        self._core.mark_degraded(key[0], key[1], reason)

    def mark_instance_degraded(self, instance_id: str, reason: str) -> int:
        """:meth:`mark_degraded` on every worker of ``instance_id`` the index has (a reader that
        skipped a malformed message keyed by it); returns how many. It makes no worker, and
        costs the instance's ranks, not a pass over every worker."""
        return int(self._core.mark_instance_degraded(instance_id, reason))

    def load_worker_snapshot(
        self,
        key: WorkerKey,
        windows: Mapping[int, Iterable[KVCacheStoredData]],
        *,
        last_event_id: int | None,
        capacities: Mapping[int, Sequence[int]] | None = None,
    ) -> None:
        """Replace everything ``key`` holds with a snapshot of its cache, and clear its flag.

        ``windows`` maps each window size to the snapshot's Stored data, parents before
        children (a block whose parent is unknown is stored as an orphan, as for events).
        ``last_event_id`` is the id of the last event the snapshot reflects: later events
        apply on top, earlier ones are replays. None leaves the cursor unset (the next
        event is accepted as if it were the worker's first).
        """
        instance_id, rank = key[0], key[1]
        self._core.reset_worker(instance_id, rank, True)
        capacities = capacities or {}
        for window, stored in windows.items():
            self._core.load_window(instance_id, rank, window, capacities.get(window), stored)
        for window, capacity in capacities.items():
            if window not in windows:
                self._core.load_window(instance_id, rank, window, capacity, ())
        self._core.set_cursor(instance_id, rank, last_event_id)

    def to_bytes(self) -> bytes:
        """The whole index state (blocks, sessions, cursors, degraded flags), canonical:
        equal states give equal bytes, whichever core. Counters are not included."""
        return encode_state(self._core.export_state())

    @classmethod
    def from_bytes(
        cls, data: bytes | bytearray | memoryview, *, core: str = "auto", limits: BatchLimits | None = None
    ) -> CacheIndex:
        """An index restored from :meth:`to_bytes` (ValueError naming what is wrong)."""
        index = cls(core=core, limits=limits)
        index._core.import_state(decode_state(data))
        return index

    def same_state(self, other: CacheIndex) -> bool:
        """Whether both indexes hold the same state (what :meth:`to_bytes` saves)."""
        return self.to_bytes() == other.to_bytes()


def _max_level(value: int | None) -> int:
    if value is None:
        return LEVEL_MAX
    if value < 0:
        raise ValueError(f"max_cache_level must be >= 0, got {value}")
    return min(value, LEVEL_MAX)


COUNTERS = COUNTER_NAMES
"""Names of the counters in ``IndexStats.counters``."""
