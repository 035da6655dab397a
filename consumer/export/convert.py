"""kvevents batches -> vLLM events per worker, with the state vLLM's wire needs.

vLLM's events name a block's *medium* on removal and carry tokens on every store; kvevents'
Removed and Updated events do not, so the converter remembers, per worker and window size, each
held block's level, parent, tokens and LoRA id. Per event:

- Created -> ``AllBlocksCleared`` (once per run of back-to-back Created events: the other
  window sizes of one cache), the worker's blocks forgotten;
- Stored -> ``BlockStored`` per run of blocks with the same medium, LoRA id and size (a block
  already held on another medium is first removed there);
- Removed -> ``BlockRemoved`` per medium (blocks never seen are skipped and counted);
- Updated level ``a -> b`` -> ``BlockRemoved`` on the medium the block was published on (``a``'s
  when the producer is consistent) + ``BlockStored`` on ``b``'s (vLLM's tier move); a priority
  change has no vLLM counterpart.

Loss is signalled the only way vLLM's wire can: a worker whose events were lost (in-band drops,
an event-id jump, missing batches, a new producer session not starting at sequence 0) gets an
``AllBlocksCleared`` and starts afresh; the producer's snapshot (Created + Stored) refills it.
Duplicates (Kafka's at-least-once, a producer replaying) are skipped by event id.

Speed: ``token_ids`` go out as ``msgspec.Raw`` bytes packed straight from the blocks'
``array('i')`` (:mod:`.packed`), not as a list of Python ints to encode.
"""

from __future__ import annotations

import logging
from array import array
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from itertools import pairwise
from typing import Any

import msgspec
from kvevents.schemas import (
    EventBatch,
    KVCacheCreatedData,
    KVCacheRemovedData,
    KVCacheStoredData,
    KVCacheUpdatedData,
)
from msgspec import Raw

from ..workers import WorkerKey
from .packed import extra_keys, pack_hash, pack_hashes, pack_tokens
from .vllm_wire import MEDIUM_BY_LEVEL, VllmWire, medium_for_level

log = logging.getLogger(__name__)

__all__ = ["ConverterCounters", "ConverterState", "VllmConverter"]

# A held block: (level, parent hash, tokens as the event's array('i'), LoRA id, vLLM extra_keys
# entry or None). Untracked values only, so the garbage collector soon stops scanning them.
_LEVEL, _PARENT, _TOKENS, _LORA, _EXTRA = 0, 1, 2, 3, 4


class _Worker:
    __slots__ = ("created_run", "cursor", "windows")

    def __init__(self) -> None:
        self.cursor: int | None = None
        self.created_run = False
        self.windows: dict[int, dict[int, tuple[Any, ...]]] = {}


class _SavedWorker(msgspec.Struct, array_like=True):
    instance_id: str
    rank: int
    cursor: int | None
    created_run: bool
    windows: dict[int, list[tuple[int, int, int | None, bytes, int | None, Any]]]
    """window -> (hash, level, parent, tokens as array('i') bytes, LoRA id, vLLM extra_keys entry)."""


class ConverterState(msgspec.Struct):
    """What a converter remembers, serializable (the exporter's restart state)."""

    workers: list[_SavedWorker] = []
    sessions: dict[str, tuple[int, int]] = {}


@dataclass
class ConverterCounters:
    """What the converter did, for logs and the command's summary."""

    batches: int = 0
    events_in: int = 0
    events_out: int = 0
    duplicates: int = 0
    clears_for_loss: int = 0
    unknown_removed: int = 0
    unknown_updated: int = 0
    priority_only_updates: int = 0
    loss_reasons: dict[str, int] = field(default_factory=dict)


_STATE_ENCODER = msgspec.msgpack.Encoder()
_STATE_DECODER = msgspec.msgpack.Decoder(ConverterState)


class _Media(dict[int, str]):
    """Level -> medium name; only the named levels are kept (every level past 3 is EXTERNAL:
    a stream of ever new levels grew the map)."""

    def __missing__(self, level: int) -> str:
        value = medium_for_level(level)
        if 0 <= level < len(MEDIUM_BY_LEVEL):
            self[level] = value
        return value


class LoraNames(dict[int | None, str | None]):
    """LoRA id -> the ``lora_name`` sent for it. An id without a configured name is sent as
    its decimal string (as ``export dynamo`` seeds it), with a warning the first time: llm-d
    and Dynamo key adapters by name only, and a null name made an adapter's blocks count as
    the base model's (false hits for base-model requests)."""

    def __init__(self, names: Mapping[int, str] | None = None) -> None:
        super().__init__(names or {})
        self[None] = None
        self.unnamed = 0
        """Lookups of ids without a configured name: the first ``WARN_UNNAMED`` are warned
        about, the first ``KEEP_UNNAMED`` remembered (a stream of ever new ids logged and kept
        each one: 655k ids, 130 MB of log)."""

    WARN_UNNAMED = 16
    KEEP_UNNAMED = 1024

    def __missing__(self, lora_id: int | None) -> str | None:
        name = str(lora_id)
        self.unnamed += 1
        if self.unnamed <= self.WARN_UNNAMED:
            log.warning(
                "LoRA id %s has no --lora-name: sent as lora_name %r (routers key adapters by name: "
                "give the adapter's name with --lora-name %s=NAME)%s",
                lora_id,
                name,
                lora_id,
                "; no more such warnings" if self.unnamed == self.WARN_UNNAMED else "",
            )
        if self.unnamed <= self.KEEP_UNNAMED:
            self[lora_id] = name
        return name


class VllmConverter:
    """Converts batches in topic order; ``convert(batch)`` returns ``{worker: [vLLM events]}``.

    ``on_loss(worker, reason)`` is called when a worker is cleared for lost events; ``lora_names``
    gives the ``lora_name`` of a LoRA id (else null: kvevents carries ids).
    """

    def __init__(
        self,
        wire: VllmWire,
        state: ConverterState | None = None,
        on_loss: Callable[[WorkerKey, str], None] | None = None,
        lora_names: Mapping[int, str] | None = None,
    ) -> None:
        self.wire = wire
        self.lora_names = LoraNames(lora_names)
        """LoRA id -> adapter name, sent as ``lora_name`` (vLLM keys adapters by name)."""
        self.counters = ConverterCounters()
        self._on_loss = on_loss
        self._media = _Media(MEDIUM_BY_LEVEL)
        self._workers: dict[WorkerKey, _Worker] = {}
        self._ranks: dict[str, set[int]] = {}
        """Per instance, the ranks of ``_workers``: a session change or a gap looks at its own
        workers, not every instance's (32k instances made each ~1 ms)."""
        self._sessions: dict[str, list[int]] = {}
        if state is not None:
            self._load(state)

    # ------------------------------------------------------------------ state

    def _load(self, state: ConverterState) -> None:
        for saved in state.workers:
            worker = _Worker()
            worker.cursor = saved.cursor
            worker.created_run = saved.created_run
            for window, blocks in saved.windows.items():
                held = worker.windows[window] = {}
                for block_hash, level, parent, tokens, lora_id, extra in blocks:
                    arr = array("i")
                    arr.frombytes(tokens)
                    held[block_hash] = (level, parent, arr, lora_id, _frozen(extra))
            self._workers[WorkerKey(saved.instance_id, saved.rank)] = worker
            self._ranks.setdefault(saved.instance_id, set()).add(saved.rank)
        self._sessions = {k: list(v) for k, v in state.sessions.items()}

    def state(self) -> ConverterState:
        """A serializable copy of what the converter remembers."""
        return ConverterState(
            [
                _SavedWorker(
                    key[0],
                    key[1],
                    w.cursor,
                    w.created_run,
                    {
                        window: [
                            (h, b[_LEVEL], b[_PARENT], b[_TOKENS].tobytes(), b[_LORA], b[_EXTRA])
                            for h, b in blocks.items()
                        ]
                        for window, blocks in w.windows.items()
                    },
                )
                for key, w in sorted(self._workers.items())
            ],
            {k: (v[0], v[1]) for k, v in self._sessions.items()},
        )

    def state_bytes(self) -> bytes:
        return _STATE_ENCODER.encode(self.state())

    @staticmethod
    def state_from_bytes(data: bytes) -> ConverterState:
        return _STATE_DECODER.decode(data)

    def held_blocks(self, key: WorkerKey) -> dict[int, int]:
        """``{block hash: level}`` of every block the converter knows ``key`` holds."""
        worker = self._workers.get(WorkerKey(*key))
        if worker is None:
            return {}
        return {h: b[_LEVEL] for blocks in worker.windows.values() for h, b in blocks.items()}

    # ------------------------------------------------------------------ loss

    def _worker(self, key: WorkerKey) -> _Worker:
        worker = self._workers.get(key)
        if worker is None:
            worker = self._workers[key] = _Worker()
            self._ranks.setdefault(key[0], set()).add(key[1])
        return worker

    def _lose(self, out: dict[WorkerKey, list[Any]], key: WorkerKey, worker: _Worker, reason: str) -> None:
        worker.windows = {}
        worker.created_run = False
        worker.cursor = None  # start afresh: the ids that follow a loss jump by design
        events = out.get(key)
        if events is None:
            events = out[key] = []
        events.append(self.wire.cleared)
        c = self.counters
        c.clears_for_loss += 1
        c.loss_reasons[reason] = c.loss_reasons.get(reason, 0) + 1
        if self._on_loss is not None:
            self._on_loss(key, reason)

    def lose_instance(self, instance: str, reason: str) -> dict[WorkerKey, list[Any]]:
        """Clear every known worker of ``instance`` (e.g. one of its messages was unreadable)."""
        out: dict[WorkerKey, list[Any]] = {}
        for rank in sorted(self._ranks.get(instance, ())):
            key = WorkerKey(instance, rank)
            self._lose(out, key, self._workers[key], reason)
        self.counters.events_out += sum(len(v) for v in out.values())
        return out

    def _session(self, batch: EventBatch, out: dict[WorkerKey, list[Any]]) -> bool:
        """Track the instance's producer session; True if this batch is a replay."""
        instance = batch.instance_id
        session = self._sessions.get(instance)
        lost: str | None = None
        replay = False
        if session is None or session[0] != batch.producer_id:
            if session is not None and batch.sequence != 0:
                lost = "a new producer session did not start at sequence 0"
            self._sessions[instance] = [batch.producer_id, batch.sequence]
            if session is not None:  # event ids restart with a new session
                for rank in self._ranks.get(instance, ()):
                    self._workers[WorkerKey(instance, rank)].cursor = None
        elif batch.sequence <= session[1]:
            replay = True
        else:
            if batch.sequence > session[1] + 1:
                lost = f"batches {session[1] + 1}..{batch.sequence - 1} are missing"
            session[1] = batch.sequence
        if lost is not None:
            ranks = set(range(batch.attention_dp_size)) | self._ranks.get(instance, set())
            for rank in sorted(ranks):
                key = WorkerKey(instance, rank)
                self._lose(out, key, self._worker(key), lost)
        if not replay:
            for drop in batch.dropped:
                if drop.dropped_events > 0:
                    key = WorkerKey(instance, drop.attention_dp_rank)
                    self._lose(out, key, self._worker(key), f"{drop.dropped_events} events dropped")
        return replay

    # ------------------------------------------------------------------ converting

    def convert(self, batch: EventBatch) -> dict[WorkerKey, list[Any]]:
        """The vLLM events of one batch, per worker, in order (workers with none are absent)."""
        out: dict[WorkerKey, list[Any]] = {}
        c = self.counters
        c.batches += 1
        c.events_in += len(batch.events)
        replay = self._session(batch, out)
        instance = batch.instance_id
        fragment = batch.first_event_block_offset > 0 and not replay
        wire = self.wire
        removed_type, stored_type = wire.BlockRemoved, wire.BlockStored
        media = self._media
        names = self.lora_names
        pack = pack_tokens
        last_rank: int | None = -1
        key = WorkerKey(instance, 0)
        worker = _Worker()
        events: list[Any] = []
        first = True
        # the window's blocks of the current worker, looked up again when the window changes
        window: int | None = None
        blocks: dict[int, tuple[Any, ...]] | None = None
        for event in batch.events:
            rank = event.attention_dp_rank
            if rank != last_rank:
                last_rank = rank
                key = WorkerKey(instance, rank or 0)
                worker = self._workers.get(key) or self._worker(key)
                got = out.get(key)
                events = out[key] = [] if got is None else got
                window = None
            eid = event.event_id
            cursor = worker.cursor
            if cursor is not None:
                if eid <= cursor:
                    if not (first and fragment and eid == cursor):
                        c.duplicates += 1
                        first = False
                        continue
                elif eid != cursor + 1:
                    self._lose(out, key, worker, f"event ids jumped from {cursor} to {eid}")
                    window = None
            first = False
            worker.cursor = eid
            data = event.data
            kind = type(data)
            if kind is KVCacheCreatedData:
                if not worker.created_run:
                    events.append(wire.cleared)
                    worker.windows = {}
                worker.windows[event.window_size] = {}
                worker.created_run = True
                window = None
                continue
            if worker.created_run:
                worker.created_run = False
            if event.window_size != window:
                window = event.window_size
                blocks = worker.windows.get(window)
            if kind is KVCacheUpdatedData:
                diff = data.cache_level
                if diff is None:
                    c.priority_only_updates += 1
                    continue
                new = diff.new_value
                h = data.block_hash
                held = None if blocks is None else blocks.get(h)
                if held is None or blocks is None:
                    c.unknown_updated += 1
                    continue
                # the move is from where subscribers were told the block is, whatever the diff's
                # old value says (a BlockRemoved on another medium would leave a ghost copy)
                old = held[_LEVEL]
                if old == new:
                    continue
                blocks[h] = (new, held[_PARENT], held[_TOKENS], held[_LORA], held[_EXTRA])
                events.append(removed_type(pack_hashes([h]), media[old]))
                extra = held[_EXTRA]
                events.append(
                    stored_type(
                        pack_hashes([h]),
                        pack_hash(held[_PARENT]),
                        Raw(pack((held[_TOKENS],))),
                        len(held[_TOKENS]),
                        held[_LORA],
                        media[new],
                        names[held[_LORA]],
                        None if extra is None else [extra],
                    )
                )
            elif kind is KVCacheRemovedData:
                if blocks is None:
                    c.unknown_removed += len(data.block_hashes)
                    continue
                hashes = data.block_hashes
                if len(hashes) == 1:  # the common case: one block evicted
                    held = blocks.pop(hashes[0], None)
                    if held is None:
                        c.unknown_removed += 1
                    else:
                        events.append(removed_type(pack_hashes(hashes), media[held[_LEVEL]]))
                    continue
                by_level: dict[int, list[int]] = {}
                for h in hashes:
                    held = blocks.pop(h, None)
                    if held is None:
                        c.unknown_removed += 1
                        continue
                    group = by_level.get(held[_LEVEL])
                    if group is None:
                        by_level[held[_LEVEL]] = [h]
                    else:
                        group.append(h)
                for level, group in by_level.items():
                    events.append(removed_type(pack_hashes(group), media[level]))
            elif kind is KVCacheStoredData:
                if blocks is None:
                    blocks = worker.windows[window] = {}
                self._stored(blocks, data, events)
        result = {k: v for k, v in out.items() if v}
        for v in result.values():
            c.events_out += len(v)
        return result

    def _stored(self, blocks: dict[int, tuple[Any, ...]], data: KVCacheStoredData, events: list[Any]) -> None:
        wire = self.wire
        media = self._media
        names = self.lora_names
        stored_blocks = data.blocks
        moved: dict[int, list[int]] | None = None
        for block in stored_blocks:  # held on another medium: removed there first (a tier move)
            held = blocks.get(block.block_hash)
            if held is not None and held[_LEVEL] != block.cache_level:
                if moved is None:
                    moved = {}
                moved.setdefault(held[_LEVEL], []).append(block.block_hash)
        if moved:
            for level, hashes in moved.items():
                events.append(wire.removed(pack_hashes(hashes), media[level]))
        if not stored_blocks:
            return
        parent = data.parent_hash
        extras: list[Any] = []
        cuts = [0]  # where a run of blocks of one medium, LoRA id and size starts: one BlockStored each
        previous = None
        for i, block in enumerate(stored_blocks):
            tokens = block.tokens
            lora_id = block.lora_id
            if previous is not None and (
                block.cache_level != previous.cache_level
                or lora_id != previous.lora_id
                or len(tokens) != len(previous.tokens)
            ):
                cuts.append(i)
            extra = None
            if block.mm_keys or (block.cache_salt is not None and parent is None):
                # the LoRA name travels in lora_name only: llm-d reads any string here as a
                # multimodal identifier, so a named adapter's blocks never matched there
                extra = extra_keys(None, block.mm_keys, block.cache_salt if parent is None else None)
            blocks[block.block_hash] = (block.cache_level, parent, tokens, lora_id, extra)
            extras.append(extra)
            parent = block.block_hash
            previous = block
        cuts.append(len(stored_blocks))
        stored_type = wire.BlockStored
        parent = data.parent_hash
        for start, end in pairwise(cuts):
            run = stored_blocks[start:end]
            first = run[0]
            run_extra = extras[start:end]
            events.append(
                stored_type(
                    pack_hashes([b.block_hash for b in run]),
                    pack_hash(parent),
                    Raw(pack_tokens([b.tokens for b in run])),
                    len(first.tokens),
                    first.lora_id,
                    media[first.cache_level],
                    names[first.lora_id],
                    run_extra if any(e is not None for e in run_extra) else None,
                )
            )
            parent = run[-1].block_hash


def _frozen(extra: Any) -> Any:
    """A saved extra_keys entry (lists after msgpack) back as tuples, as built."""
    if extra is None:
        return None
    return tuple(tuple(k) if isinstance(k, list) else k for k in extra)
