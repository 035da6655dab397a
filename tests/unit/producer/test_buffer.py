"""EventBuffer: the C++ truncation rule (worker()), exact drop counts, and the gather's seams."""

from __future__ import annotations

import logging
import threading
import time

import pytest
from kvevents.producer import EventBuffer, EventDrain
from kvevents.schemas import KVCacheEvent, KVCacheRemovedData, RankDrops


def ev(event_id: int, window_size: int = 32, rank: int | None = None) -> KVCacheEvent:
    return KVCacheEvent(event_id, KVCacheRemovedData([event_id]), window_size, rank)


def ids(events: list[KVCacheEvent]) -> list[int]:
    return [e.event_id for e in events]


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.mark.parametrize("capacity", [0, -1, 1.5, True, None])
def test_capacity_must_be_a_positive_int(capacity: object) -> None:
    with pytest.raises(ValueError, match="capacity"):
        EventBuffer(capacity)  # type: ignore[arg-type]


def test_within_capacity_nothing_is_dropped_and_order_is_kept() -> None:
    buf = EventBuffer(5)
    assert buf.extend([ev(0), ev(1)]) == 0
    assert buf.extend([ev(2), ev(3), ev(4)]) == 0
    assert len(buf) == 5
    assert ids(buf.take(0)) == [0, 1, 2, 3, 4]
    assert buf.stats().events_dropped_total == 0


def test_overflow_drops_oldest_from_the_buffer_first() -> None:
    buf = EventBuffer(4)
    buf.extend([ev(0), ev(1), ev(2)])
    assert buf.extend([ev(3), ev(4)]) == 1
    assert ids(buf.take(0)) == [1, 2, 3, 4]


def test_overflow_beyond_the_buffer_drops_from_the_front_of_the_new_batch() -> None:
    buf = EventBuffer(3)
    buf.extend([ev(0), ev(1)])
    assert buf.extend([ev(2), ev(3), ev(4), ev(5), ev(6)]) == 4
    assert ids(buf.take(0)) == [4, 5, 6]


def test_drops_are_counted_per_rank_and_window_of_each_dropped_event() -> None:
    buf = EventBuffer(2)
    buf.extend([ev(0, 16, rank=0), ev(0, 32, rank=1)])
    # Overflows by 3: both buffered events and the first new one go.
    buf.extend([ev(1, 32, rank=1), ev(2, 32, rank=1), ev(1, 64, rank=2)])
    stats = buf.stats()
    assert stats.events_dropped_total == 3
    assert stats.events_dropped_by_rank == {0: 1, 1: 2}
    assert stats.events_dropped_by_window_size == {16: 1, 32: 2}
    assert ids(buf.take(0)) == [2, 1]


def test_events_without_a_rank_count_as_rank_0() -> None:
    buf = EventBuffer(1)
    buf.extend([ev(0), ev(1)])
    assert buf.stats().events_dropped_by_rank == {0: 1}


def test_record_drops_counts_remote_drops_per_rank_without_a_window() -> None:
    buf = EventBuffer(10)
    buf.record_drops(3, 7)
    buf.record_drops(3, 2)
    buf.record_drops(1, 0)
    buf.record_drops(0, 4, window_size=32)
    stats = buf.stats()
    assert stats.events_dropped_by_rank == {3: 9, 0: 4}
    assert stats.events_dropped_by_window_size == {32: 4}
    assert stats.events_dropped_total == 13
    assert buf.drain(0).dropped == [RankDrops(0, 4), RankDrops(3, 9)]


def test_a_drain_stops_before_drops_recorded_behind_older_events() -> None:
    """Drops a rank reported (``record_drops``) while older events were buffered: a drain takes
    the events older than them, the next drain starts with the drops (a consumer applies a
    batch's drops before its events). With nothing buffered, they go with the next drain."""
    buf = EventBuffer(10)
    buf.record_drops(1, 2)  # nothing buffered
    buf.extend([ev(0, rank=1), ev(1, rank=1)])
    buf.record_drops(1, 5)  # after events 0-1
    buf.extend([ev(2, rank=1)])
    buf.record_drops(2, 1)  # after event 2
    buf.extend([ev(3, rank=2)])
    first, second, third = buf.drain(0), buf.drain(0), buf.drain(0)
    assert (ids(first.events), first.dropped) == ([0, 1], [RankDrops(1, 2)])
    assert (ids(second.events), second.dropped) == ([2], [RankDrops(1, 5)])
    assert (ids(third.events), third.dropped) == ([3], [RankDrops(2, 1)])
    assert [first.more, second.more, third.more] == [True, True, False]  # drain again at once
    assert buf.drain(0) == EventDrain([], [])
    assert buf.stats().events_dropped_by_rank == {1: 7, 2: 1}


def test_drops_behind_events_that_are_dropped_or_taken_go_with_the_next_drain() -> None:
    buf = EventBuffer(3)
    buf.extend([ev(0), ev(1)])
    buf.record_drops(1, 4)
    buf.extend([ev(2), ev(3), ev(4)])  # 0 and 1 dropped: nothing is older than the 4 now
    drain = buf.drain(0)
    assert (ids(drain.events), drain.dropped) == ([2, 3, 4], [RankDrops(0, 2), RankDrops(1, 4)])
    buf.extend([ev(5)])
    buf.record_drops(2, 1)
    assert ids(buf.take(0)) == [5]
    assert buf.drain(0) == EventDrain([], [RankDrops(2, 1)])
    buf.extend([ev(6)])
    buf.record_drops(3, 1)
    assert buf.drain(0, whole=True) == EventDrain([ev(6)], [RankDrops(3, 1)])  # a last message


@pytest.mark.parametrize(("rank", "count"), [(-1, 1), (1, -1), (True, 1), (1, 1.0)])
def test_record_drops_rejects_bad_arguments(rank: object, count: object) -> None:
    with pytest.raises(ValueError):
        EventBuffer(1).record_drops(rank, count)  # type: ignore[arg-type]


def test_drain_takes_events_and_the_drops_since_the_previous_drain() -> None:
    buf = EventBuffer(2)
    buf.extend([ev(0, rank=1), ev(1, rank=1), ev(2, rank=1)])
    first = buf.drain(0)
    assert ids(first.events) == [1, 2]
    assert first.dropped == [RankDrops(1, 1)]
    assert first.dropped_events_total == 1
    buf.extend([ev(3, rank=1)])
    second = buf.drain(0)
    assert ids(second.events) == [3]
    assert second.dropped == []
    assert buf.drain(0) == EventDrain([], [])
    # The cumulative counter is not reset by draining.
    assert buf.stats().events_dropped_total == 1


def test_take_leaves_drop_counts_for_the_next_drain() -> None:
    buf = EventBuffer(1)
    buf.extend([ev(0), ev(1)])
    assert ids(buf.take(0)) == [1]
    assert buf.drain(0).dropped == [RankDrops(0, 1)]


def test_drain_wakes_for_drops_alone() -> None:
    buf = EventBuffer(1)
    result: list[EventDrain] = []
    reader = threading.Thread(target=lambda: result.append(buf.drain(10)))
    reader.start()
    time.sleep(0.05)
    buf.record_drops(2, 5)
    reader.join(5)
    assert result == [EventDrain([], [RankDrops(2, 5)])]


def test_take_waits_for_events_and_times_out_empty() -> None:
    buf = EventBuffer(3)
    start = time.monotonic()
    assert buf.take(0.05) == []
    assert time.monotonic() - start >= 0.04
    result: list[list[KVCacheEvent]] = []
    reader = threading.Thread(target=lambda: result.append(buf.take()))
    reader.start()
    time.sleep(0.05)
    assert reader.is_alive()
    buf.extend([ev(9)])
    reader.join(5)
    assert [ids(r) for r in result] == [[9]]


def test_take_does_not_wake_for_drops_alone() -> None:
    buf = EventBuffer(1)
    buf.record_drops(1, 1)
    assert buf.take(0.02) == []


@pytest.mark.parametrize("timeout", [-1, float("nan"), "1", True])
def test_bad_timeouts_are_rejected(timeout: object) -> None:
    with pytest.raises(ValueError, match="timeout"):
        EventBuffer(1).take(timeout)  # type: ignore[arg-type]


def test_close_wakes_every_waiter_and_events_stay_readable() -> None:
    buf = EventBuffer(3)
    results: list[object] = []
    readers = [threading.Thread(target=lambda: results.append(buf.take())) for _ in range(3)]
    readers += [threading.Thread(target=lambda: results.append(buf.drain())) for _ in range(2)]
    for r in readers:
        r.start()
    time.sleep(0.05)
    buf.close()
    buf.close()
    for r in readers:
        r.join(5)
        assert not r.is_alive()
    assert sorted(map(repr, results)) == sorted([repr([])] * 3 + [repr(EventDrain([], []))] * 2)
    buf.extend([ev(1)])
    assert ids(buf.take()) == [1]
    assert buf.take() == []  # closed: never waits


def test_high_water_mark_is_the_largest_size_ever_held() -> None:
    buf = EventBuffer(10)
    buf.extend([ev(i) for i in range(4)])
    buf.take(0)
    buf.extend([ev(i) for i in range(3)])
    assert buf.stats().buffer_high_water_mark == 4
    buf.extend([ev(i) for i in range(20)])
    stats = buf.stats()
    assert stats.buffer_high_water_mark == 10 == stats.capacity
    assert stats.buffered_events == 10
    assert stats.events_added_total == 27


def test_drop_warning_is_rate_limited_and_reports_the_count_since_the_previous_one(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = FakeClock()
    buf = EventBuffer(1, drop_warning_interval_s=10, clock=clock)
    caplog.set_level(logging.WARNING, logger="kvevents.producer.buffer")
    for i in range(100):
        buf.extend([ev(2 * i), ev(2 * i + 1)])  # 100 overflowing batches
        clock.now += 0.01
    assert len(caplog.records) == 1
    assert "max size of 1" in caplog.records[0].getMessage()
    clock.now += 10
    buf.extend([ev(1000)])
    assert len(caplog.records) == 2
    # Batch 1 drops 1 event, batches 2..100 drop 2 each (the buffered one and the first new
    # one), the last batch 1: 200 in all, of which the first warning reported 1.
    assert buf.stats().events_dropped_total == 200
    message = caplog.records[1].getMessage()
    assert "199 events have been discarded since the previous warning (200 in total)" in message


def test_close_logs_drops_no_warning_reported(caplog: pytest.LogCaptureFixture) -> None:
    clock = FakeClock()
    buf = EventBuffer(1, drop_warning_interval_s=60, clock=clock)
    caplog.set_level(logging.WARNING, logger="kvevents.producer.buffer")
    buf.extend([ev(0), ev(1)])
    buf.extend([ev(2), ev(3), ev(4)])
    assert len(caplog.records) == 1
    buf.close()
    assert len(caplog.records) == 2
    assert "3 events discarded since the previous warning (4 in total)" in caplog.records[1].getMessage()
