"""The managers ``bench/producer.py`` measures the engine thread of kvevents' manager against: the
naive port of the C++ design, a no-op floor, and the manager on its pure-Python engine path."""

from __future__ import annotations

import queue
import threading
import time
from typing import Any

from kvevents.producer import BlockInfo, EventBuffer, KVCacheEventManager
from kvevents.producer._recorder import PyRecorder
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


class NaiveManager:
    """The same engine API, building ``KVCacheEvent``/``KVCacheStoredBlockData`` objects in
    each ``enqueue_*`` (the C++ design, ``enqueueEvent({mEventId++, data, ...})``, ported
    directly), handing each iteration off with a list swap + ``queue.SimpleQueue.put`` (the
    straightforward choice; it wakes the blocked worker with a system call each flush, which the
    manager's polled deque avoids) and the same ``EventBuffer`` behind it."""

    def __init__(self, capacity: int, rank: int | None = None) -> None:
        self._rank = rank
        self._queue: list[KVCacheEvent] = []
        self._next_id = 0
        self.buffer = EventBuffer(capacity, drop_warning_interval_s=3600)
        self._pending: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._work, daemon=True)
        self._thread.start()

    def _work(self) -> None:
        while (events := self._pending.get()) is not None:
            if isinstance(events, threading.Event):
                events.set()
            else:
                self.buffer.extend(events)

    def enqueue_created_event(self, levels: list[int], window_size: int) -> None:
        self._queue.append(
            KVCacheEvent(self._next_id, KVCacheCreatedData(list(levels)), window_size, self._rank)
        )
        self._next_id += 1

    def enqueue_stored_event(self, blocks: list[BlockInfo], window_size: int) -> None:
        if not blocks:
            return
        data = KVCacheStoredData(
            blocks[0].prev_block_hash,
            [
                KVCacheStoredBlockData(
                    b.block_hash,
                    b.tokens,
                    b.lora_id,
                    PRIMARY_LEVEL if b.is_primary else SECONDARY_LEVEL,
                    b.priority,
                    b.token_extra_ids,
                    b.mm_keys,
                    b.cache_salt,
                )
                for b in blocks
            ],
        )
        self._queue.append(KVCacheEvent(self._next_id, data, window_size, self._rank))
        self._next_id += 1

    def enqueue_removed_event(self, block_hash: int, window_size: int) -> None:
        q = self._queue
        if q and q[-1].window_size == window_size and q[-1].data.__class__ is KVCacheRemovedData:
            q[-1].data.block_hashes.append(block_hash)  # type: ignore[union-attr]
        else:
            q.append(KVCacheEvent(self._next_id, KVCacheRemovedData([block_hash]), window_size, self._rank))
            self._next_id += 1

    def enqueue_updated_event(self, data: KVCacheUpdatedData, window_size: int) -> None:
        self._queue.append(KVCacheEvent(self._next_id, data, window_size, self._rank))
        self._next_id += 1

    def flush(self) -> None:
        events = self._queue
        if not events:
            return
        self._queue = []
        self._pending.put(events)

    def drain(self, timeout: float | None = None) -> Any:
        return self.buffer.drain(timeout)

    def settle(self, timeout: float | None = None) -> bool:
        marker = threading.Event()
        self._pending.put(marker)
        return marker.wait(timeout)

    def close(self) -> None:
        self._pending.put(None)
        self._thread.join()
        self.buffer.close()


class NoopManager:
    """Same signatures, no work: the floor (Python loop + method call) of every row."""

    def enqueue_updated_event(self, data: object, window_size: int) -> None:
        pass

    def flush(self) -> None:
        pass

    def drain(self, timeout: float | None = None) -> None:
        time.sleep(timeout or 0)

    def settle(self, timeout: float | None = None) -> bool:
        return True

    def close(self) -> None:
        pass


class PurePythonManager(KVCacheEventManager):
    """The manager on its pure-Python engine path (the fallback of the compiled recorder)."""

    _recorder_factory = PyRecorder
