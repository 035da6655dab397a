"""Small event and batch builders for the CLI's unit tests."""

from __future__ import annotations

from collections.abc import Sequence

from kvevents.schemas import (
    EventBatch,
    KVCacheCreatedData,
    KVCacheEvent,
    KVCacheEventDiff,
    KVCacheRemovedData,
    KVCacheStoredBlockData,
    KVCacheStoredData,
    KVCacheUpdatedData,
    RankDrops,
)

WINDOW = 64
BLOCK = 4


def tokens_of(h: int) -> list[int]:
    return [(h % 1_000_000) * 10 + i for i in range(BLOCK)]


def created(eid: int, rank: int = 0, levels: Sequence[int] = (100, 10)) -> KVCacheEvent:
    return KVCacheEvent(eid, KVCacheCreatedData(list(levels)), WINDOW, rank)


def stored(
    eid: int, hashes: Sequence[int], parent: int | None = None, rank: int = 0, level: int = 0
) -> KVCacheEvent:
    blocks = [KVCacheStoredBlockData(h, tokens_of(h), cache_level=level) for h in hashes]
    return KVCacheEvent(eid, KVCacheStoredData(parent, blocks), WINDOW, rank)


def removed(eid: int, hashes: Sequence[int], rank: int = 0) -> KVCacheEvent:
    return KVCacheEvent(eid, KVCacheRemovedData(list(hashes)), WINDOW, rank)


def updated(
    eid: int,
    h: int,
    level: tuple[int, int] | None = None,
    priority: tuple[int, int] | None = None,
    rank: int = 0,
) -> KVCacheEvent:
    diff = None if level is None else KVCacheEventDiff(*level)
    prio = None if priority is None else KVCacheEventDiff(*priority)
    return KVCacheEvent(eid, KVCacheUpdatedData(h, diff, prio), WINDOW, rank)


def batch(
    events: Sequence[KVCacheEvent],
    seq: int,
    instance: str = "i0",
    pid: int = 7,
    dp: int = 2,
    dropped: Sequence[tuple[int, int]] = (),
    time_us: int = 0,
) -> EventBatch:
    return EventBatch(
        instance,
        list(events),
        attention_dp_size=dp,
        producer_id=pid,
        sequence=seq,
        created_at_us=time_us,
        dropped=[RankDrops(r, n) for r, n in dropped],
    )
