"""The manager's background worker: turns flushed iterations into events and buffers them.

An iteration is ``(first_id, records)`` with ``records`` flat, ``[window_size, payload, ...]``;
the payload's class tells the event type: ``KVCacheCreatedData`` / ``KVCacheUpdatedData`` as
is, a ``BlockInfo`` or a tuple of them (Stored), an ``int`` or a list of hashes (Removed). The
worker polls the deque while events flow and parks when idle; why, and the race-free parking
protocol: ``docs/ARCHITECTURE.md``.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections import deque
from typing import Any

from kvevents.schemas import (
    PRIMARY_LEVEL,
    SECONDARY_LEVEL,
    KVCacheCreatedData,
    KVCacheEvent,
    KVCacheRemovedData,
    KVCacheStoredBlockData,
    KVCacheStoredData,
    KVCacheUpdatedData,
)

from .block import BlockInfo
from .buffer import EventBuffer

__all__ = ["PARK_AFTER_IDLE_S", "POLL_INTERVAL_S", "STOP", "Iteration", "Worker"]

log = logging.getLogger(__name__)

Iteration = tuple[int, list[Any]]
"""``(first_id, [window_size, payload, ...])`` as flushed by the engine thread."""

STOP = object()
"""Appended to the pending deque to make the worker exit once everything before it is buffered."""

POLL_INTERVAL_S = 0.001
"""How often the worker looks for flushed iterations while events flow."""
PARK_AFTER_IDLE_S = 1.0
"""After this long without work the worker parks until the next flush wakes it."""

_TYPE_OF_PAYLOAD = {
    KVCacheCreatedData: "created",
    BlockInfo: "stored",
    tuple: "stored",
    int: "removed",
    list: "removed",
    KVCacheUpdatedData: "updated",
}


def _stored_block(block: BlockInfo) -> KVCacheStoredBlockData:
    return KVCacheStoredBlockData(
        block.block_hash,
        block.tokens,
        block.lora_id,
        PRIMARY_LEVEL if block.is_primary else SECONDARY_LEVEL,
        block.priority,
        block.token_extra_ids,
        block.mm_keys,
        block.cache_salt,
    )


class Worker:
    """Runs on its own daemon thread; holds no reference to the manager, so an unreferenced
    manager can be collected (its finalizer calls :meth:`stop_soon`).

    ``pending`` holds, in order: :data:`Iteration` tuples (one per flush), ``threading.Event``
    markers (set once everything before them is buffered) and ``STOP``.
    """

    def __init__(self, buffer: EventBuffer, attention_dp_rank: int | None) -> None:
        self.pending: deque[object] = deque()
        self.parked = False
        self._wake = threading.Lock()
        self._wake.acquire()  # held while nobody needs to wake the worker
        self._buffer = buffer
        self._rank = attention_dp_rank
        self._rank_key = 0 if attention_dp_rank is None else attention_dp_rank
        self.iterations_processed = 0
        self.events_by_type = {"created": 0, "stored": 0, "removed": 0, "updated": 0}
        self.stored_blocks = 0
        self.removed_hashes = 0
        self.thread = threading.Thread(target=self._run, name="kvevents-manager-worker", daemon=True)

    def wake(self, *, now: bool = False) -> None:
        """Wake the worker if it is parked (a cheap no-op otherwise), or, with ``now``, also
        cut its current poll short (costs a system call: not for the engine's flush).
        Call after appending."""
        if self.parked or now:
            self.parked = False
            with contextlib.suppress(RuntimeError):  # another thread woke it first
                self._wake.release()

    def stop_soon(self) -> None:
        """Make the worker exit after buffering everything already pending."""
        self.pending.append(STOP)
        self.wake(now=True)

    def _run(self) -> None:
        pending = self.pending
        popleft = pending.popleft
        park_after = max(1, round(PARK_AFTER_IDLE_S / POLL_INTERVAL_S))
        idle_polls = (
            park_after  # parked until the first flush: a manager that has seen no event costs nothing
        )
        while True:
            if not pending:
                idle_polls += 1
                if idle_polls < park_after:
                    self._wake.acquire(timeout=POLL_INTERVAL_S)
                    continue
                self.parked = True
                if not pending:  # re-check after announcing: a flush in between is not missed
                    self._wake.acquire()
                self.parked = False
                continue
            idle_polls = 0
            iterations: list[Iteration] = []
            markers: list[threading.Event] = []
            stop = False
            while pending:
                item = popleft()
                if item is STOP:
                    stop = True
                    break
                if item.__class__ is tuple:
                    iterations.append(item)
                else:
                    markers.append(item)  # type: ignore[arg-type]
            if iterations:
                self.iterations_processed += len(iterations)
                self._process(iterations)
            for marker in markers:
                marker.set()
            if stop:
                return

    def _process(self, iterations: list[Iteration]) -> None:
        # The oldest new events beyond the capacity would be dropped even from an empty buffer:
        # count them without building them.
        skip = sum(len(records) for _, records in iterations) // 2 - self._buffer.capacity
        if skip > 0:
            kept: list[Iteration] = []
            for first_id, records in iterations:
                if skip > 0:
                    n = len(records) // 2
                    self._discard(first_id, records[: 2 * skip])
                    if skip >= n:
                        skip -= n
                        continue
                    first_id, records, skip = first_id + skip, records[2 * skip :], 0
                kept.append((first_id, records))
            iterations = kept
        try:
            self._buffer.extend(self._build(iterations))
        except Exception:  # a bug here must neither kill the worker nor lose events silently
            count = sum(len(records) for _, records in iterations) // 2
            log.exception("Could not buffer %d KV-cache events; counted as dropped", count)
            for first_id, records in iterations:
                self._discard(first_id, records)

    def _build(self, iterations: list[Iteration]) -> list[KVCacheEvent]:
        """One pass: build every event and count types, blocks and hashes (this loop is the
        worker's cost per event, and under a saturated GIL also the engine's)."""
        rank = self._rank
        events: list[KVCacheEvent] = []
        append = events.append
        stored = removed = created = blocks = hashes = 0
        for event_id, records in iterations:
            pairs = iter(records)
            for window_size, payload in zip(pairs, pairs, strict=True):
                cls = payload.__class__
                if cls is BlockInfo:
                    data: object = KVCacheStoredData(payload.prev_block_hash, [_stored_block(payload)])
                    stored += 1
                    blocks += 1
                elif cls is int:
                    data = KVCacheRemovedData([payload])
                    removed += 1
                    hashes += 1
                elif cls is tuple:
                    data = KVCacheStoredData(payload[0].prev_block_hash, [_stored_block(b) for b in payload])
                    stored += 1
                    blocks += len(payload)
                elif cls is list:
                    data = KVCacheRemovedData(payload)
                    removed += 1
                    hashes += len(payload)
                else:
                    data = payload
                    if cls is KVCacheCreatedData:
                        created += 1
                append(KVCacheEvent(event_id, data, window_size, rank))  # type: ignore[arg-type]
                event_id += 1
        by_type = self.events_by_type
        by_type["stored"] += stored
        by_type["removed"] += removed
        by_type["created"] += created
        by_type["updated"] += len(events) - stored - removed - created
        self.stored_blocks += blocks
        self.removed_hashes += hashes
        return events

    def _discard(self, first_id: int, records: list[Any]) -> None:
        """Count events that will never be built (types, blocks, hashes) as flushed and dropped."""
        by_type = self.events_by_type
        by_window: dict[int, int] = {}
        newest: dict[int, int] = {}
        event_id = first_id
        pairs = iter(records)
        for window_size, payload in zip(pairs, pairs, strict=True):
            cls = payload.__class__
            by_type[_TYPE_OF_PAYLOAD[cls]] += 1
            if cls is BlockInfo:
                self.stored_blocks += 1
            elif cls is tuple:
                self.stored_blocks += len(payload)
            elif cls is int:
                self.removed_hashes += 1
            elif cls is list:
                self.removed_hashes += len(payload)
            by_window[window_size] = by_window.get(window_size, 0) + 1
            newest[window_size] = event_id
            event_id += 1
        for window_size, count in by_window.items():
            self._buffer.record_drops(
                self._rank_key, count, window_size=window_size, newest_event_id=newest[window_size]
            )

    def drop_leftovers(self) -> None:
        """Once the worker has exited: count iterations left in ``pending`` (flushed after
        ``close()``) as dropped and release any marker. Safe to call from several threads."""
        dropped = 0
        while True:
            try:
                item = self.pending.popleft()
            except IndexError:
                break
            if item.__class__ is tuple:
                first_id, records = item
                self.iterations_processed += 1
                self._discard(first_id, records)
                dropped += len(records) // 2
            elif item is not STOP:
                item.set()  # type: ignore[attr-defined]
        if dropped:
            log.warning("flush() after close(): %d KV-cache events dropped", dropped)
