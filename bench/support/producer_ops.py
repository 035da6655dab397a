"""One engine iteration's calls of each ``enqueue_*`` operation ``bench/producer.py`` times, and the
events they enqueue."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvevents.producer import BlockInfo
from kvevents.schemas import KVCacheEventDiff, KVCacheUpdatedData

BLOCKS_4X32 = [BlockInfo(1000 + i, (999 + i) if i else None, range(32 * i, 32 * i + 32)) for i in range(4)]
UPDATED = KVCacheUpdatedData(77, priority=KVCacheEventDiff(35, 90))
LEVELS = [4096, 1024]


def removed_new(m: Any, calls: int, base: int) -> None:
    enqueue = m.enqueue_removed_event
    for h in range(base, base + calls, 2):  # alternating windows: every call opens a new event
        enqueue(h, 16)
        enqueue(h + 1, 32)


def removed_merged(m: Any, calls: int, base: int) -> None:
    enqueue = m.enqueue_removed_event
    for h in range(base, base + calls):  # same window: appended to the open Removed event
        enqueue(h, 32)


def updated(m: Any, calls: int, base: int) -> None:
    enqueue, data = m.enqueue_updated_event, UPDATED
    for _ in range(calls):
        enqueue(data, 32)


def stored(m: Any, calls: int, base: int) -> None:
    enqueue, blocks = m.enqueue_stored_event, BLOCKS_4X32
    for _ in range(calls):
        enqueue(blocks, 32)


def created(m: Any, calls: int, base: int) -> None:
    enqueue = m.enqueue_created_event
    for _ in range(calls):
        enqueue(LEVELS, 32)


def noop_op(m: Any, calls: int, base: int) -> None:
    enqueue, data = m.enqueue_updated_event, UPDATED
    for _ in range(calls):
        enqueue(data, 32)


OPERATIONS: dict[str, Callable[[Any, int, int], None]] = {
    "enqueue_removed_new": removed_new,
    "enqueue_removed_merged": removed_merged,
    "enqueue_updated": updated,
    "enqueue_stored_4x32": stored,
    "enqueue_created": created,
}
"""Each runs ``calls`` calls of one operation (``flush`` is timed after every one of them)."""
