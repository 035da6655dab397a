"""Small builders for index tests: events and batches with as little noise as possible."""

from __future__ import annotations

from collections.abc import Sequence

from kvevents.consumer import WorkerKey
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
    encode_batch,
)

WINDOW = 64
BLOCK = 4
W0 = WorkerKey("i0", 0)  # the workers of batch()'s default instance, ranks 0 and 1
W1 = WorkerKey("i0", 1)


def tokens_of(h: int) -> list[int]:
    """Distinct tokens per engine hash, so content follows the hash in simple tests."""
    return [(h % 100_000_000) * 10 + i for i in range(BLOCK)]


def tokens_for(hashes: Sequence[int]) -> list[int]:
    """The tokens of a prefix of engine hashes, block after block (``tokens_of`` each)."""
    return [t for h in hashes for t in tokens_of(h)]


def block(
    h: int, level: int = 0, priority: int = 35, tokens: Sequence[int] | None = None, **kw: object
) -> KVCacheStoredBlockData:
    return KVCacheStoredBlockData(
        h, tokens_of(h) if tokens is None else tokens, cache_level=level, priority=priority, **kw
    )  # type: ignore[arg-type]


def created(
    eid: int,
    window: int = WINDOW,
    rank: int | None = None,
    levels: Sequence[int] = (100, 10),
    snapshot: bool = False,
) -> KVCacheEvent:
    return KVCacheEvent(eid, KVCacheCreatedData(list(levels), snapshot), window, rank)


def stored(
    eid: int,
    hashes: Sequence[int],
    parent: int | None = None,
    window: int = WINDOW,
    rank: int | None = None,
    level: int = 0,
) -> KVCacheEvent:
    return KVCacheEvent(eid, KVCacheStoredData(parent, [block(h, level) for h in hashes]), window, rank)


def stored_blocks(
    eid: int,
    blocks: Sequence[KVCacheStoredBlockData],
    parent: int | None = None,
    window: int = WINDOW,
    rank: int | None = None,
) -> KVCacheEvent:
    return KVCacheEvent(eid, KVCacheStoredData(parent, list(blocks)), window, rank)


def removed(eid: int, hashes: Sequence[int], window: int = WINDOW, rank: int | None = None) -> KVCacheEvent:
    return KVCacheEvent(eid, KVCacheRemovedData(list(hashes)), window, rank)


def updated(
    eid: int,
    h: int,
    level: tuple[int, int] | None = None,
    priority: tuple[int, int] | None = None,
    window: int = WINDOW,
    rank: int | None = None,
) -> KVCacheEvent:
    return KVCacheEvent(
        eid,
        KVCacheUpdatedData(
            h,
            None if level is None else KVCacheEventDiff(*level),
            None if priority is None else KVCacheEventDiff(*priority),
        ),
        window,
        rank,
    )


def batch(
    events: Sequence[KVCacheEvent],
    seq: int,
    instance: str = "i0",
    pid: int = 7,
    dp: int = 1,
    dropped: Sequence[tuple[int, int]] = (),
    offset: int = 0,
) -> EventBatch:
    return EventBatch(
        instance,
        list(events),
        attention_dp_size=dp,
        producer_id=pid,
        sequence=seq,
        dropped=[RankDrops(r, n) for r, n in dropped],
        first_event_block_offset=offset,
    )


def shared_prefix_batches(n: int) -> list[bytes]:
    """Encoded batches: a Created one for 8 ranks, then ``n`` in which each rank stores three
    events of 40 blocks on one shared 32-block prefix."""
    prefix = list(range(1, 33))
    out = [encode_batch(batch([created(0, rank=r) for r in range(8)], 0, dp=8))]
    for s in range(1, n + 1):
        events = []
        for r in range(8):
            for k in range(3):
                eid = 3 * (s - 1) + k + 1
                tail = [10**6 * (r + 1) + 1000 * eid + j for j in range(8)]
                events.append(stored(eid, prefix + tail, rank=r))
        out.append(encode_batch(batch(events, s, dp=8)))
    return out
