"""The sink's bounded queue (drop oldest, counted) and its loss ledger (pending until reported)."""

from __future__ import annotations

import pytest
from kvevents.producer.sink_chunks import Chunk, SplitEvent
from kvevents.producer.sink_queue import LOSS_REASONS, MAX_REPORTED, ChunkQueue, LossLedger
from kvevents.schemas import RankDrops


def chunk(events: int, size: int = 10, rank: int = 0, split: SplitEvent | None = None) -> Chunk:
    return Chunk(memoryview(b"x" * size), events, {} if split else {rank: events}, {rank: 0}, split=split)


def test_the_oldest_chunks_go_first_when_events_exceed_the_bound() -> None:
    queue = ChunkQueue(max_events=10, max_bytes=10**9)
    a, b, c, d = chunk(4, rank=0), chunk(4, rank=1), chunk(4, rank=2), chunk(3, rank=3)
    assert queue.push(a) == [] and queue.push(b) == []
    assert queue.push(c) == [a]
    assert queue.push(d) == [b]
    assert (len(queue), queue.events, queue.bytes, queue.high_water_events) == (2, 7, 20, 12)
    assert queue.pop() is c and queue.pop() is d and not queue


def test_the_byte_bound_drops_oldest_too_and_the_newest_chunk_always_stays() -> None:
    queue = ChunkQueue(max_events=10**6, max_bytes=100)
    first = chunk(1, size=60)
    queue.push(first)
    assert queue.push(chunk(1, size=60)) == [first]
    huge = chunk(1, size=500)
    assert len(queue.push(huge)) == 1 and queue.peek() is huge  # alone over the bound, kept
    assert (queue.events, queue.bytes) == (1, 500)


def test_dropping_a_fragment_drops_its_queued_siblings() -> None:
    split = SplitEvent(rank=2, event_id=9, fragments=3)
    queue = ChunkQueue(max_events=4, max_bytes=10**9)
    fragments = [chunk(1, split=split) for _ in range(3)]
    for fragment in fragments:
        queue.push(fragment)
    tail = chunk(2, rank=1)
    dropped = queue.push(tail)
    assert dropped == fragments  # one was enough for the bound; the siblings are useless alone
    assert queue.peek() is tail and queue.events == 2


def test_replace_head_keeps_order_and_totals() -> None:
    queue = ChunkQueue(10, 10**9)
    head, rest = chunk(4), chunk(2)
    queue.push(head)
    queue.push(rest)
    parts = [chunk(1, size=3), chunk(3, size=4)]
    queue.replace_head(parts)
    assert [queue.pop() for _ in range(3)] == [*parts, rest]
    assert (queue.events, queue.bytes) == (0, 0)


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, None])
def test_bounds_are_checked(bad: object) -> None:
    with pytest.raises(ValueError, match="max_events"):
        ChunkQueue(bad, 10)  # type: ignore[arg-type]


def test_split_events_count_once_as_lost_or_delivered() -> None:
    lost_late = SplitEvent(0, 1, fragments=3)
    assert [lost_late.deliver(), lost_late.deliver(), lost_late.lose()] == [0, 0, 1]
    lost_twice = SplitEvent(0, 2, fragments=3)
    assert [lost_twice.lose(), lost_twice.deliver(), lost_twice.lose()] == [1, 0, 0]
    whole = SplitEvent(0, 3, fragments=2)
    assert [whole.deliver(), whole.deliver()] == [0, 1]


def test_the_ledger_keeps_each_loss_pending_until_a_delivered_batch_carries_it() -> None:
    ledger = LossLedger()
    ledger.manager_dropped([RankDrops(0, 5), RankDrops(3, 0)])
    ledger.lose({1: 2, 0: 1}, "queue_full")
    carried = ledger.take()
    assert carried == [RankDrops(0, 6), RankDrops(1, 2)] and ledger.pending == {}
    assert ledger.carried == {0: 6, 1: 2} and ledger.unreported() == {0: 6, 1: 2}
    assert ledger.take() == []
    ledger.lose({1: 4}, "delivery_failed")
    ledger.restore(carried)  # the batch that carried them failed
    assert ledger.pending == {0: 6, 1: 6} and ledger.carried == {}
    again = ledger.take()
    ledger.delivered(again)
    assert ledger.reported == {0: 6, 1: 6} and ledger.pending == {} == ledger.carried == ledger.unreported()
    assert ledger.from_manager == {0: 5}
    assert ledger.lost_by_rank() == {0: 1, 1: 6}
    assert ledger.lost_by_reason() == dict.fromkeys(LOSS_REASONS, 0) | {"queue_full": 3, "delivery_failed": 4}


def test_a_loss_past_an_avro_long_is_carried_over_several_batches() -> None:
    ledger = LossLedger()
    ledger.manager_dropped([RankDrops(0, 2**64 + 5), RankDrops(1, 7)])
    assert ledger.reportable() == [RankDrops(0, MAX_REPORTED), RankDrops(1, 7)]
    first = ledger.take()
    assert first == [RankDrops(0, MAX_REPORTED), RankDrops(1, 7)]
    second = ledger.take()
    assert second == [RankDrops(0, MAX_REPORTED)]
    ledger.restore(second)  # that batch failed: pending again, still at most one long a batch
    assert ledger.take() == second
    assert ledger.take() == [RankDrops(0, 2**64 + 5 - 2 * MAX_REPORTED)]
    assert ledger.take() == [] and not ledger.pending


def test_a_loss_waits_for_a_chunk_queued_after_it() -> None:
    """A chunk queued before a loss may hold older events: it does not carry the loss (a consumer
    takes a batch's drops to precede its events); the next chunk, or a batch with no events, does."""
    queue, ledger = ChunkQueue(100, 10**9), LossLedger()
    older = Chunk(memoryview(b"x"), 1, {0: 1}, {0: 4})
    queue.push(older)
    ledger.manager_dropped([RankDrops(0, 10)], after=queue.pushed)
    ledger.lose({1: 2}, "oversized", after=queue.pushed)
    ledger.lose({2: 3}, "queue_full")  # no place given: any batch
    assert older.number == 0 and queue.pushed == 1
    assert ledger.take(older.number) == [RankDrops(2, 3)]
    assert ledger.pending == {0: 10, 1: 2}
    newer = Chunk(memoryview(b"y"), 1, {0: 1}, {0: 20})
    queue.push(newer)
    assert ledger.reportable(newer.number) == [RankDrops(0, 10), RankDrops(1, 2)]
    carried = ledger.take(newer.number)
    ledger.restore(carried)  # its batch failed: any later batch may carry them
    assert ledger.take(0) == carried and not ledger.waiting
    ledger.lose({0: 1}, "delivery_failed", after=queue.pushed)
    assert ledger.take(newer.number) == [] and ledger.take(None) == [RankDrops(0, 1)]  # no events
    queue.pop()
    queue.replace_head([Chunk(memoryview(b"y"), 0, {}, {}), Chunk(memoryview(b"z"), 1, {0: 1}, {})])
    assert [queue.pop().number, queue.pop().number] == [1, 1]  # a re-split chunk's pieces keep its place
