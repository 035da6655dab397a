"""kvevents batches -> vLLM events per worker, with the state vLLM's wire needs.

vLLM's events name a block's *medium* on removal and carry tokens on every store; kvevents'
Removed and Updated events do not, so the converter remembers, per worker and window size, each
held block's level, parent, tokens and LoRA id. Per event:

- Created -> ``AllBlocksCleared`` (once per run of back-to-back Created events: the other
  window sizes of one cache), the worker's blocks forgotten;
- Stored -> ``BlockStored`` per run of blocks with the same medium, LoRA id and size (a block
  already held on another medium is first removed there);
- Removed -> ``BlockRemoved`` per medium (blocks never seen are skipped and counted);
- Updated level ``a -> b`` -> ``BlockRemoved`` on ``a``'s medium + ``BlockStored`` on ``b``'s
  (vLLM's tier move); a priority change has no vLLM counterpart.

Loss is signalled the only way vLLM's wire can: a worker whose events were lost (in-band drops,
an event-id jump, missing batches, a new producer session not starting at sequence 0) gets an
``AllBlocksCleared`` and starts afresh; the producer's snapshot (Created + Stored) refills it.
Duplicates (Kafka's at-least-once, a producer replaying) are skipped by event id.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec
from kvevents.schemas import (
    EventBatch,
    KVCacheCreatedData,
    KVCacheRemovedData,
    KVCacheStoredBlockData,
    KVCacheStoredData,
    KVCacheUpdatedData,
)

from ..workers import WorkerKey
from .vllm_wire import VllmWire, medium_for_level

__all__ = ["ConverterCounters", "ConverterState", "VllmConverter"]


class _Block(msgspec.Struct, array_like=True, gc=False):
    level: int
    parent: int | None
    tokens: bytes  # array('i') bytes
    lora_id: int | None


class _Worker(msgspec.Struct, gc=False):
    cursor: int | None = None
    created_run: bool = False
    windows: dict[int, dict[int, _Block]] = {}


class _Session(msgspec.Struct, array_like=True, gc=False):
    producer_id: int
    sequence: int


class ConverterState(msgspec.Struct):
    """What a converter remembers (serializable, for the exporter's restart state)."""

    workers: dict[str, dict[int, _Worker]] = {}
    sessions: dict[str, _Session] = {}


@dataclass
class ConverterCounters:
    """What the converter did, for logs and ``--stats``."""

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


class VllmConverter:
    """Converts batches in topic order; ``convert(batch)`` returns ``{worker: [vLLM events]}``.

    ``on_loss(worker, reason)`` is called when a worker is cleared for lost events.
    """

    def __init__(
        self,
        wire: VllmWire,
        state: ConverterState | None = None,
        on_loss: Callable[[WorkerKey, str], None] | None = None,
    ) -> None:
        self.wire = wire
        self.state = state if state is not None else ConverterState()
        self.counters = ConverterCounters()
        self._on_loss = on_loss

    # ------------------------------------------------------------------ state

    def state_bytes(self) -> bytes:
        return _STATE_ENCODER.encode(self.state)

    @staticmethod
    def state_from_bytes(data: bytes) -> ConverterState:
        return _STATE_DECODER.decode(data)

    def held_blocks(self, key: WorkerKey) -> dict[int, int]:
        """``{block hash: level}`` of every block the converter knows ``key`` holds."""
        worker = self.state.workers.get(key[0], {}).get(key[1])
        if worker is None:
            return {}
        return {h: b.level for blocks in worker.windows.values() for h, b in blocks.items()}

    # ------------------------------------------------------------------ converting

    def _worker(self, instance: str, rank: int) -> _Worker:
        ranks = self.state.workers.get(instance)
        if ranks is None:
            ranks = self.state.workers[instance] = {}
        worker = ranks.get(rank)
        if worker is None:
            worker = ranks[rank] = _Worker(windows={})
        return worker

    def _lose(self, out: dict[WorkerKey, list[Any]], key: WorkerKey, worker: _Worker, reason: str) -> None:
        worker.windows = {}
        worker.created_run = False
        out.setdefault(key, []).append(self.wire.cleared)
        c = self.counters
        c.clears_for_loss += 1
        c.events_out += 1
        c.loss_reasons[reason] = c.loss_reasons.get(reason, 0) + 1
        if self._on_loss is not None:
            self._on_loss(key, reason)

    def lose_instance(self, instance: str, reason: str) -> dict[WorkerKey, list[Any]]:
        """Clear every known worker of ``instance`` (e.g. one of its messages was unreadable)."""
        out: dict[WorkerKey, list[Any]] = {}
        for rank, worker in sorted(self.state.workers.get(instance, {}).items()):
            self._lose(out, WorkerKey(instance, rank), worker, reason)
        return out

    def _session(self, batch: EventBatch, out: dict[WorkerKey, list[Any]]) -> bool:
        """Track the instance's producer session; True if this batch is a replay."""
        instance = batch.instance_id
        session = self.state.sessions.get(instance)
        lost: str | None = None
        replay = False
        if session is None or session.producer_id != batch.producer_id:
            if session is not None and batch.sequence != 0:
                lost = "a new producer session did not start at sequence 0"
            self.state.sessions[instance] = _Session(batch.producer_id, batch.sequence)
            if session is not None:  # event ids restart with a new session
                for worker in self.state.workers.get(instance, {}).values():
                    worker.cursor = None
        elif batch.sequence <= session.sequence:
            replay = True
        else:
            if batch.sequence > session.sequence + 1:
                lost = f"batches {session.sequence + 1}..{batch.sequence - 1} are missing"
            session.sequence = batch.sequence
        if lost is not None:
            ranks = set(range(batch.attention_dp_size)) | set(self.state.workers.get(instance, {}))
            for rank in sorted(ranks):
                self._lose(out, WorkerKey(instance, rank), self._worker(instance, rank), lost)
        if not replay:
            for drop in batch.dropped:
                if drop.dropped_events > 0:
                    rank = drop.attention_dp_rank
                    key = WorkerKey(instance, rank)
                    self._lose(
                        out, key, self._worker(instance, rank), f"{drop.dropped_events} events dropped"
                    )
        return replay

    def convert(self, batch: EventBatch) -> dict[WorkerKey, list[Any]]:
        """The vLLM events of one batch, per worker, in order (workers with none are absent)."""
        out: dict[WorkerKey, list[Any]] = {}
        c = self.counters
        c.batches += 1
        c.events_in += len(batch.events)
        replay = self._session(batch, out)
        instance = batch.instance_id
        fragment = batch.first_event_block_offset > 0 and not replay
        for i, event in enumerate(batch.events):
            rank = event.attention_dp_rank or 0
            worker = self._worker(instance, rank)
            key = WorkerKey(instance, rank)
            eid = event.event_id
            cursor = worker.cursor
            if cursor is not None:
                continuing = i == 0 and fragment and eid == cursor
                if eid <= cursor and not continuing:
                    c.duplicates += 1
                    continue
                if eid > cursor + 1:
                    self._lose(out, key, worker, f"event ids jumped from {cursor} to {eid}")
            worker.cursor = eid
            events = out.get(key)
            if events is None:
                events = out[key] = []
            before = len(events)
            data = event.data
            if isinstance(data, KVCacheStoredData):
                worker.created_run = False
                self._stored(worker.windows.setdefault(event.window_size, {}), data, events)
            elif isinstance(data, KVCacheRemovedData):
                worker.created_run = False
                self._removed(worker.windows.get(event.window_size, {}), data.block_hashes, events)
            elif isinstance(data, KVCacheUpdatedData):
                worker.created_run = False
                self._updated(worker.windows.get(event.window_size, {}), data, events)
            elif isinstance(data, KVCacheCreatedData):
                if not worker.created_run:
                    events.append(self.wire.cleared)
                    worker.windows = {}
                worker.windows[event.window_size] = {}
                worker.created_run = True
            c.events_out += len(events) - before
        return {k: v for k, v in out.items() if v}

    def _stored(self, blocks: dict[int, _Block], data: KVCacheStoredData, events: list[Any]) -> None:
        wire = self.wire
        moved: dict[int, list[int]] = {}
        for block in data.blocks:  # held on another medium: removed there first (a tier move)
            held = blocks.get(block.block_hash)
            if held is not None and held.level != block.cache_level:
                moved.setdefault(held.level, []).append(block.block_hash)
        for level, hashes in moved.items():
            events.append(wire.removed(hashes, medium_for_level(level)))
        parent = data.parent_hash
        run: list[KVCacheStoredBlockData] = []
        run_parent = parent
        for block in data.blocks:
            blocks[block.block_hash] = _Block(
                block.cache_level, parent, block.tokens.tobytes(), block.lora_id
            )
            if run and not _same_run(run[0], block):
                events.append(_stored_event(wire, run, run_parent))
                run, run_parent = [], parent
            run.append(block)
            parent = block.block_hash
        if run:
            events.append(_stored_event(wire, run, run_parent))

    def _removed(self, blocks: dict[int, _Block], hashes: list[int], events: list[Any]) -> None:
        by_medium: dict[int, list[int]] = {}
        for h in hashes:
            held = blocks.pop(h, None)
            if held is None:
                self.counters.unknown_removed += 1
                continue
            by_medium.setdefault(held.level, []).append(h)
        for level, group in by_medium.items():
            events.append(self.wire.removed(group, medium_for_level(level)))

    def _updated(self, blocks: dict[int, _Block], data: KVCacheUpdatedData, events: list[Any]) -> None:
        diff = data.cache_level
        if diff is None or diff.old_value == diff.new_value:
            if diff is None:
                self.counters.priority_only_updates += 1
            return
        held = blocks.get(data.block_hash)
        if held is None:
            self.counters.unknown_updated += 1
            return
        old = held.level
        held.level = diff.new_value
        tokens = array("i")
        tokens.frombytes(held.tokens)
        wire = self.wire
        events.append(wire.removed([data.block_hash], medium_for_level(old)))
        events.append(
            wire.stored(
                [data.block_hash],
                held.parent,
                tokens.tolist(),
                len(tokens),
                held.lora_id,
                medium_for_level(diff.new_value),
            )
        )


def _same_run(first: KVCacheStoredBlockData, block: KVCacheStoredBlockData) -> bool:
    return (
        first.cache_level == block.cache_level
        and first.lora_id == block.lora_id
        and len(first.tokens) == len(block.tokens)
    )


def _stored_event(wire: VllmWire, run: list[KVCacheStoredBlockData], parent: int | None) -> Any:
    first = run[0]
    if len(run) == 1:
        token_ids = first.tokens.tolist()
    else:
        flat = array("i")
        for block in run:
            flat.extend(block.tokens)
        token_ids = flat.tolist()
    return wire.stored(
        [b.block_hash for b in run],
        parent,
        token_ids,
        len(first.tokens),
        first.lora_id,
        medium_for_level(first.cache_level),
    )
