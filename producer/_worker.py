"""The manager's background worker: turns flushed iterations into events and buffers them.

The engine thread records each event as a ``(event_id, window_size, payload)`` tuple, where the
payload's class tells the event type:

- ``KVCacheCreatedData`` / ``KVCacheUpdatedData``: the event data itself (immutable);
- ``tuple`` of ``BlockInfo``: a Stored event, built here into ``KVCacheStoredData``;
- ``list`` of block hashes: a Removed event (a list because the engine thread appends merged
  hashes to it until the iteration is flushed; the worker only sees it afterwards).

``flush()`` puts the iteration's list of records on a ``queue.SimpleQueue``; the worker takes
every iteration waiting there at once. Appending iterations one by one or together gives the
same buffer and the same drop counts (keeping the newest ``capacity`` events of a concatenation
is associative), so the worker batches them, and skips building the events that would be
dropped anyway (more than ``capacity`` new ones): under overload its cost stays bounded.
"""

from __future__ import annotations

import logging
import queue
import threading

from kvevents.schemas import (
    PRIMARY_LEVEL,
    SECONDARY_LEVEL,
    KVCacheCreatedData,
    KVCacheEvent,
    KVCacheEventData,
    KVCacheRemovedData,
    KVCacheStoredBlockData,
    KVCacheStoredData,
    KVCacheUpdatedData,
)

from .block import BlockInfo
from .buffer import EventBuffer

__all__ = ["STOP", "Record", "Worker", "build_event"]

log = logging.getLogger(__name__)

Record = tuple[int, int, object]
"""``(event_id, window_size, payload)`` as recorded by the engine thread."""

STOP = object()
"""Put on the pending queue to make the worker exit once everything before it is buffered."""

_TYPE_OF_PAYLOAD = {
    KVCacheCreatedData: "created",
    tuple: "stored",
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


def build_data(payload: object) -> KVCacheEventData:
    """The event data for one recorded payload (see the module docstring)."""
    cls = payload.__class__
    if cls is tuple:
        blocks: tuple[BlockInfo, ...] = payload  # type: ignore[assignment]
        return KVCacheStoredData(blocks[0].prev_block_hash, [_stored_block(b) for b in blocks])
    if cls is list:
        return KVCacheRemovedData(payload)  # type: ignore[arg-type]
    return payload  # type: ignore[return-value]


def build_event(record: Record, attention_dp_rank: int | None) -> KVCacheEvent:
    """The ``KVCacheEvent`` for one record."""
    event_id, window_size, payload = record
    return KVCacheEvent(event_id, build_data(payload), window_size, attention_dp_rank)


class Worker:
    """Runs on its own daemon thread; holds no reference to the manager, so an unreferenced
    manager can be collected (its finalizer puts ``STOP``)."""

    def __init__(self, pending: queue.SimpleQueue[object], buffer: EventBuffer, attention_dp_rank: int | None) -> None:
        self._pending = pending
        self._buffer = buffer
        self._rank = attention_dp_rank
        self._rank_key = 0 if attention_dp_rank is None else attention_dp_rank
        self.iterations_processed = 0
        self.events_by_type = {"created": 0, "stored": 0, "removed": 0, "updated": 0}
        self.stored_blocks = 0
        self.removed_hashes = 0
        self.thread = threading.Thread(target=self._run, name="kvevents-manager-worker", daemon=True)

    def _run(self) -> None:
        get, get_nowait = self._pending.get, self._pending.get_nowait
        while True:
            items = [get()]
            try:
                while True:
                    items.append(get_nowait())
            except queue.Empty:
                pass
            records: list[Record] = []
            markers: list[threading.Event] = []
            stop = False
            for item in items:
                if item is STOP:
                    stop = True
                elif item.__class__ is list:
                    records += item  # type: ignore[arg-type]
                    self.iterations_processed += 1
                else:
                    markers.append(item)  # type: ignore[arg-type]
            if records:
                try:
                    self._process(records)
                except Exception:  # a bug here must neither kill the worker nor lose events silently
                    log.exception("Could not buffer %d KV-cache events; counted as dropped", len(records))
                    self._drop(records)
            for marker in markers:
                marker.set()
            if stop:
                return

    def _process(self, records: list[Record]) -> None:
        # The oldest new records beyond the capacity would be dropped even from an empty
        # buffer: count them without building them.
        skip = max(0, len(records) - self._buffer.capacity)
        rank = self._rank
        events = [build_event(record, rank) for record in records[skip:]]
        self._count(records)
        if skip:
            self._drop(records[:skip])
        self._buffer.extend(events)

    def _count(self, records: list[Record]) -> None:
        by_type = self.events_by_type
        for _, _, payload in records:
            cls = payload.__class__
            by_type[_TYPE_OF_PAYLOAD[cls]] += 1
            if cls is tuple:
                self.stored_blocks += len(payload)  # type: ignore[arg-type]
            elif cls is list:
                self.removed_hashes += len(payload)  # type: ignore[arg-type]

    def _drop(self, records: list[Record]) -> None:
        by_window: dict[int, int] = {}
        for _, window_size, _ in records:
            by_window[window_size] = by_window.get(window_size, 0) + 1
        for window_size, count in by_window.items():
            self._buffer.record_drops(self._rank_key, count, window_size=window_size)

    def count_dropped_after_close(self, records: list[Record]) -> None:
        """Count an iteration flushed after ``close()`` (the worker is gone) as dropped."""
        log.warning("flush() after close(): %d KV-cache events dropped", len(records))
        self._count(records)
        self._drop(records)
