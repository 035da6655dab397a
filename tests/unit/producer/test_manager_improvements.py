"""Where KVCacheEventManager improves on the C++: exact drop counts, high-water mark, rate-limited
warning, checked inputs, a non-blocking engine path, thread safety, and the seams for the Kafka
sink (drain) and the attention-DP gather (buffer, close callbacks)."""

from __future__ import annotations

import gc
import itertools
import logging
import random
import threading
import time
from collections import Counter

import pytest
from kvevents.producer import BlockInfo, EventDrain, KVCacheEventManager
from kvevents.schemas import (
    KVCacheEvent,
    KVCacheEventDiff,
    KVCacheRemovedData,
    KVCacheStoredData,
    KVCacheUpdatedData,
    RankDrops,
)

W = 32

# Every test runs on the compiled engine path and on the pure-Python one (see conftest.py).
pytestmark = pytest.mark.usefixtures("recorder_impl")


def delivered(m: KVCacheEventManager) -> list[KVCacheEvent]:
    assert m.settle(5)
    return m.get_events(timeout=0)


# ---- exact drop counts ----------------------------------------------------------------------


def test_drops_are_counted_exactly_per_window_size_under_overflow() -> None:
    rng = random.Random(7)
    windows = [16, 32, 64]
    with KVCacheEventManager(10, drop_warning_interval_s=3600) as m:
        sent: list[tuple[int, int]] = []  # (event id, window)
        for _ in range(50):
            for _ in range(rng.randint(0, 8)):
                window = rng.choice(windows)
                m.enqueue_updated_event(KVCacheUpdatedData(1), window)
                sent.append((len(sent), window))
            m.flush()
        kept = delivered(m)
        stats = m.stats().buffer
    assert [e.event_id for e in kept] == [i for i, _ in sent[-10:]]
    lost = Counter(w for _, w in sent[:-10])
    assert stats.events_dropped_total == len(sent) - 10
    assert stats.events_dropped_by_window_size == {w: n for w, n in lost.items() if n}
    assert stats.events_dropped_by_rank == {0: len(sent) - 10}


def test_drops_are_counted_per_source_rank_on_rank_0_with_gathered_events() -> None:
    # Rank 0 of 3 with max 2: capacity 6. Its own events and those the gather merges for
    # ranks 1 and 2 share the buffer; each dropped event counts under its own rank.
    with KVCacheEventManager(2, attention_dp_rank=0, attention_dp_size=3, attention_dp_gather=False) as m:
        for i in range(3):
            m.enqueue_removed_event(i, 16 + i)  # rank 0: ids 0, 1, 2 (distinct windows)
        m.flush()
        assert m.settle(5)
        m.buffer.extend([KVCacheEvent(i, KVCacheRemovedData([i]), 32, 1) for i in range(4)])
        m.buffer.extend([KVCacheEvent(i, KVCacheRemovedData([i]), 64, 2) for i in range(3)])
        m.buffer.record_drops(2, 5)  # rank 2 reported 5 drops of its own buffer
        # 3 + 4 + 3 = 10 events into 6 places: the 3 of rank 0 and the first of rank 1 go.
        drain = m.drain(timeout=0)
        reported_after = m.drain(timeout=0)  # rank 2's come after its events buffered before them
        stats = m.stats().buffer
    assert [(e.attention_dp_rank, e.event_id) for e in drain.events] == [
        (1, 1),
        (1, 2),
        (1, 3),
        (2, 0),
        (2, 1),
        (2, 2),
    ]
    assert drain.dropped == [RankDrops(0, 3), RankDrops(1, 1)]
    assert reported_after.events == [] and reported_after.dropped == [RankDrops(2, 5)]
    assert stats.events_dropped_by_rank == {0: 3, 1: 1, 2: 5}
    assert stats.events_dropped_by_window_size == {16: 1, 17: 1, 18: 1, 32: 1}
    assert stats.events_dropped_total == 9


def test_a_huge_iteration_is_truncated_with_exact_counts() -> None:
    # More new events than the capacity: the worker skips building the oldest, counting them.
    with KVCacheEventManager(5) as m:
        m.enqueue_removed_event(0, 8)
        m.flush()
        assert m.settle(5)
        for i in range(1, 1001):
            m.enqueue_removed_event(i, 16 if i % 2 else 32)
        m.flush()
        kept = delivered(m)
        stats = m.stats()
    assert [e.event_id for e in kept] == [996, 997, 998, 999, 1000]
    # Dropped: id 0 (window 8) and ids 1..995, odd ones in window 16, even ones in 32.
    assert stats.buffer.events_dropped_by_window_size == {8: 1, 16: 498, 32: 497}
    assert stats.events_dropped_total == 996
    assert stats.events_flushed_by_type["removed"] == 1001


def test_high_water_mark_tracks_the_fullest_buffer() -> None:
    with KVCacheEventManager(100) as m:
        for n in (7, 3, 12, 1):
            for i in range(n):
                m.enqueue_updated_event(KVCacheUpdatedData(i), W)
            m.flush()
            delivered(m)
        assert m.stats().buffer.buffer_high_water_mark == 12
        for i in range(500):
            m.enqueue_updated_event(KVCacheUpdatedData(i), W)
        m.flush()
        assert m.settle(5)
        assert m.stats().buffer.buffer_high_water_mark == 100


def test_the_drop_warning_is_rate_limited(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="kvevents.producer.buffer")
    with KVCacheEventManager(1, drop_warning_interval_s=3600) as m:
        for i in range(200):
            m.enqueue_removed_event(i, 16)
            m.enqueue_removed_event(i, 32)
            m.flush()
            assert m.settle(5)  # one overflowing batch per iteration
        assert m.stats().events_dropped_total == 399
    messages = [r.getMessage() for r in caplog.records if r.name == "kvevents.producer.buffer"]
    # One warning while dropping, one summary at close with the drops it had not reported.
    assert len(messages) == 2
    assert "1 events have been discarded" in messages[0]
    assert "398 events discarded since the previous warning (399 in total)" in messages[1]


# ---- the engine path never blocks -----------------------------------------------------------


def test_engine_never_blocks_when_nobody_reads() -> None:
    with KVCacheEventManager(10, drop_warning_interval_s=3600) as m:
        blocks = [BlockInfo(i + 1, i or None, range(32)) for i in range(4)]
        start = time.monotonic()
        for i in range(20_000):
            m.enqueue_stored_event(blocks, W)
            m.enqueue_removed_event(i, W)
            m.flush()
        elapsed = time.monotonic() - start
        assert m.settle(30)
        stats = m.stats()
    assert elapsed < 30  # generous: the point is that it returns at all, with nobody reading
    assert stats.events_enqueued_total == 40_000
    assert stats.buffer.buffered_events == 10
    assert stats.events_dropped_total == 40_000 - 10


# ---- thread safety: an engine thread and concurrent readers ---------------------------------


def _engine(
    m: KVCacheEventManager, iterations: int, seed: int, log: list[tuple[str, int, int]], pause_every: int = 0
) -> list[int]:
    """Hammer enqueue/flush; log what a reader must see, (kind, window, hash), and return the
    window of each event id (a Removed hash merges into an open Removed event of its window).
    With ``pause_every``, sleep 1 ms every that many iterations (GPU time: the GIL is free)."""
    rng = random.Random(seed)
    h = 0
    window_of_id: list[int] = []
    for iteration in range(iterations):
        if pause_every and iteration % pause_every == 0:
            time.sleep(0.001)
        open_removed: int | None = None
        for _ in range(rng.randint(0, 6)):
            h += 1
            kind = rng.choice(("stored", "removed", "removed", "updated"))
            window = rng.choice((16, 32))
            if kind == "stored":
                m.enqueue_stored_event([BlockInfo(h, None, [1, 2])], window)
            elif kind == "removed":
                m.enqueue_removed_event(h, window)
            else:
                m.enqueue_updated_event(KVCacheUpdatedData(h), window)
            log.append((kind, window, h))
            if not (kind == "removed" and open_removed == window):
                window_of_id.append(window)
            open_removed = window if kind == "removed" else None
        m.flush()
    return window_of_id


def _hashes(event: KVCacheEvent) -> list[tuple[str, int, int]]:
    data = event.data
    if isinstance(data, KVCacheStoredData):
        return [("stored", event.window_size, b.block_hash) for b in data.blocks]
    if isinstance(data, KVCacheRemovedData):
        return [("removed", event.window_size, h) for h in data.block_hashes]
    return [("updated", event.window_size, data.block_hash)]  # type: ignore[union-attr]


@pytest.mark.parametrize("reader", ["get_events", "drain"])
def test_concurrent_reader_sees_everything_once_in_order_within_capacity(reader: str) -> None:
    m = KVCacheEventManager(10_000_000)
    received: list[KVCacheEvent] = []
    done = threading.Event()

    def read() -> None:
        while not done.is_set() or m.stats().pending_iterations:
            batch = m.get_events(timeout=0.01) if reader == "get_events" else m.drain(timeout=0.01).events
            received.extend(batch)
        received.extend(m.get_events(timeout=0))

    readers = [threading.Thread(target=read) for _ in range(2)]
    for t in readers:
        t.start()
    log: list[tuple[str, int, int]] = []
    _engine(m, 5_000, seed=1, log=log)
    assert m.settle(30)
    done.set()
    for t in readers:
        t.join(30)
    m.close()
    received.extend(m.get_events(timeout=0))
    received.sort(key=lambda e: e.event_id)  # two readers: each batch is ordered, batches interleave
    ids = [e.event_id for e in received]
    assert ids == list(range(m.stats().events_enqueued_total))  # none lost, none twice
    assert [x for e in received for x in _hashes(e)] == log
    assert m.stats().events_dropped_total == 0


def test_single_reader_batches_arrive_with_strictly_increasing_ids() -> None:
    m = KVCacheEventManager(1_000_000)
    batches: list[list[KVCacheEvent]] = []
    stop = threading.Event()

    def read() -> None:
        while not stop.is_set():
            batch = m.get_events(timeout=0.01)
            if batch:
                batches.append(batch)

    t = threading.Thread(target=read)
    t.start()
    log: list[tuple[str, int, int]] = []
    _engine(m, 3_000, seed=2, log=log, pause_every=100)
    m.close()
    stop.set()
    t.join(10)
    batches.append(m.get_events(timeout=0))
    ids = [e.event_id for b in batches for e in b]
    assert all(a < b for a, b in itertools.pairwise(ids))
    assert len(ids) == m.stats().events_enqueued_total
    assert len(batches) > 2  # the reader really ran concurrently


def test_concurrent_overflow_received_plus_dropped_is_exactly_what_was_sent() -> None:
    m = KVCacheEventManager(50, drop_warning_interval_s=3600)
    received: list[KVCacheEvent] = []
    dropped = Counter[int]()
    stop = threading.Event()

    def read() -> None:
        while not stop.is_set():
            drain = m.drain(timeout=0.001)
            received.extend(drain.events)
            for d in drain.dropped:
                dropped[d.attention_dp_rank] += d.dropped_events
            time.sleep(0.002)  # a slow reader: the buffer overflows

    t = threading.Thread(target=read)
    t.start()
    log: list[tuple[str, int, int]] = []
    window_of_id = _engine(m, 20_000, seed=3, log=log)
    m.close()
    stop.set()
    t.join(10)
    final = m.drain(timeout=0)
    received.extend(final.events)
    for d in final.dropped:
        dropped[d.attention_dp_rank] += d.dropped_events
    total = m.stats().events_enqueued_total
    assert total == len(window_of_id)
    ids = [e.event_id for e in received]
    assert all(a < b for a, b in itertools.pairwise(ids))
    assert dropped[0] > 0
    assert len(ids) + dropped[0] == total
    stats = m.stats().buffer
    assert stats.events_dropped_total == dropped[0]
    # Per window: what is missing of each window is exactly that window's drop count.
    sent = Counter(window_of_id)
    arrived = Counter(e.window_size for e in received)
    assert {w: sent[w] - arrived[w] for w in sent} == stats.events_dropped_by_window_size


# ---- seams -------------------------------------------------------------------------------


def test_drain_reports_drops_since_the_previous_drain_exactly_once() -> None:
    with KVCacheEventManager(2, attention_dp_rank=1, attention_dp_size=2, attention_dp_gather=False) as m:
        for i in range(5):
            m.enqueue_updated_event(KVCacheUpdatedData(i), W)
        m.flush()
        assert m.settle(5)
        first = m.drain(timeout=0)
        assert [e.event_id for e in first.events] == [3, 4]
        assert first.dropped == [RankDrops(1, 3)]
        m.enqueue_updated_event(KVCacheUpdatedData(9), W)
        m.flush()
        assert m.settle(5)
        assert m.drain(timeout=0) == EventDrain([KVCacheEvent(5, KVCacheUpdatedData(9), W, 1)], [])


def test_close_callbacks_run_after_the_last_events_and_before_readers_wake() -> None:
    m = KVCacheEventManager(10)
    seen: list[str] = []
    woke: list[list[KVCacheEvent]] = []
    reader = threading.Thread(target=lambda: woke.append(m.get_events()))

    def gather_stop() -> None:
        # The worker has buffered the final iteration; readers are not woken yet.
        seen.append(f"buffered={len(m.buffer)} closed={m.buffer.closed}")
        m.buffer.extend([KVCacheEvent(0, KVCacheRemovedData([5]), W, 1)])  # a last gathered event

    m.add_close_callback(gather_stop)
    m.add_close_callback(lambda: seen.append("second"))
    m.enqueue_removed_event(1, W)
    m.close()
    reader.start()
    reader.join(5)
    assert seen == ["buffered=1 closed=False", "second"]
    assert [(e.attention_dp_rank, e.event_id) for e in woke[0]] == [(None, 0), (1, 0)]
    with pytest.raises(TypeError):
        m.add_close_callback(5)  # type: ignore[arg-type]


def test_settle_waits_for_the_worker_and_is_immediate_after_close() -> None:
    m = KVCacheEventManager(10)
    m.enqueue_removed_event(1, W)
    m.flush()
    assert m.settle(5)
    assert len(m.buffer) == 1
    m.close()
    assert m.settle(0)


def test_stats_count_every_kind_of_event() -> None:
    with KVCacheEventManager(100) as m:
        m.enqueue_created_event([10], W)
        m.enqueue_stored_event([BlockInfo(1, None, [1]), BlockInfo(2, 1, [2])], W)
        m.enqueue_removed_event(1, W)
        m.enqueue_removed_event(2, W)
        m.enqueue_updated_event(KVCacheUpdatedData(3), W)
        before_flush = m.stats()
        m.flush()
        m.enqueue_created_event([10], W)  # enqueued, never flushed
        assert m.settle(5)
        stats = m.stats()
        assert m.next_event_id == stats.events_enqueued_total == 5  # the cheap read agrees
    assert before_flush.events_enqueued_total == 4
    assert before_flush.iterations_flushed_total == 0
    assert before_flush.events_flushed_by_type == {"created": 0, "stored": 0, "removed": 0, "updated": 0}
    assert stats.events_enqueued_total == 5
    assert stats.iterations_flushed_total == 1
    assert stats.pending_iterations == 0
    assert stats.events_flushed_by_type == {"created": 1, "stored": 1, "removed": 1, "updated": 1}
    assert stats.stored_blocks_total == 2
    assert stats.removed_block_hashes_total == 2
    assert stats.buffer.buffered_events == 4


def test_flush_after_close_counts_the_events_as_dropped(caplog: pytest.LogCaptureFixture) -> None:
    m = KVCacheEventManager(10)
    m.close()
    m.enqueue_removed_event(1, 16)
    m.enqueue_removed_event(2, 32)
    with caplog.at_level(logging.WARNING):
        m.flush()
    stats = m.stats()
    assert stats.buffer.events_dropped_by_window_size == {16: 1, 32: 1}
    assert m.drain(timeout=0).dropped == [RankDrops(0, 2)]
    assert any("after close" in r.getMessage() for r in caplog.records)


def test_an_unreferenced_manager_stops_its_worker() -> None:
    m = KVCacheEventManager(10)
    thread = m._worker.thread
    del m
    gc.collect()
    thread.join(5)
    assert not thread.is_alive()


# ---- checked inputs -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"max_kv_event_entries": 1.5}, "max_kv_event_entries"),
        ({"max_kv_event_entries": True}, "max_kv_event_entries"),
        ({"attention_dp_rank": -1, "attention_dp_size": 2}, "attention_dp_rank"),
        ({"attention_dp_rank": 0, "attention_dp_size": 0}, "attention_dp_size"),
        ({"attention_dp_events_gather_period_ms": 0}, "gather_period"),
        ({"attention_dp_events_gather_period_ms": -5}, "gather_period"),
    ],
)
def test_bad_constructor_arguments_raise_value_error(kwargs: dict[str, object], match: str) -> None:
    args: dict[str, object] = {"max_kv_event_entries": 10}
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        KVCacheEventManager(**args)  # type: ignore[arg-type]


def test_bad_enqueue_arguments_raise_and_take_no_id() -> None:
    with KVCacheEventManager(10) as m:
        with pytest.raises(ValueError, match="block_hash"):
            m.enqueue_removed_event(-1, W)
        with pytest.raises(ValueError, match="block_hash"):
            m.enqueue_removed_event(1 << 64, W)
        with pytest.raises(TypeError, match="block_hash"):
            m.enqueue_removed_event("1", W)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="window_size"):
            m.enqueue_removed_event(1, 0)
        with pytest.raises(TypeError, match="window_size"):
            m.enqueue_updated_event(KVCacheUpdatedData(1), 32.0)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="window_size"):
            m.enqueue_created_event([1], 1 << 31)
        with pytest.raises(TypeError, match="KVCacheUpdatedData"):
            m.enqueue_updated_event({"block_hash": 1}, W)  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="BlockInfo"):
            m.enqueue_stored_event([(1, None, [1])], W)  # type: ignore[list-item]
        with pytest.raises(ValueError, match="num_blocks_per_cache_level"):
            m.enqueue_created_event([-1], W)
        with pytest.raises(ValueError, match=r"in 0\.\.2147483647, got 2147483648"):
            m.enqueue_created_event([1 << 31], W)  # the schema's int: the sink could not send it
        with pytest.raises(ValueError, match="got <an int of 16610 bits>"):
            m.enqueue_removed_event(10**5000, W)  # repr() of it raised its own ValueError
        assert m.stats().events_enqueued_total == 0


def test_integer_like_hashes_and_windows_are_accepted() -> None:
    class Index:
        def __init__(self, value: int) -> None:
            self.value = value

        def __index__(self) -> int:
            return self.value

    with KVCacheEventManager(10) as m:
        m.enqueue_removed_event(Index(5), Index(16))  # type: ignore[arg-type]
        m.enqueue_removed_event(Index(6), 16)  # type: ignore[arg-type]
        m.flush()
        (event,) = delivered(m)
    assert event == KVCacheEvent(0, KVCacheRemovedData([5, 6]), 16)
    assert all(h.__class__ is int for h in event.data.block_hashes)  # type: ignore[union-attr]


def test_flushes_after_close_are_counted_while_a_reader_drains() -> None:
    # close() belongs to the engine side (as the C++ destructor): here the engine thread closes
    # mid-stream and goes on enqueueing and flushing, while a reader drains concurrently. Every
    # event id handed out is either read or counted as dropped, exactly once.
    m = KVCacheEventManager(10_000_000, drop_warning_interval_s=3600)
    received: list[KVCacheEvent] = []
    dropped = 0
    done = threading.Event()

    def read() -> None:
        nonlocal dropped
        while not done.is_set():
            drain = m.drain(timeout=0.001)
            received.extend(drain.events)
            dropped += drain.dropped_events_total

    reader = threading.Thread(target=read)
    reader.start()
    for i in range(3000):
        m.enqueue_updated_event(KVCacheUpdatedData(i), W)
        m.enqueue_removed_event(i, W)
        if i == 2000:
            m.close()
        m.flush()
    done.set()
    reader.join(10)
    final = m.drain(timeout=0)
    received.extend(final.events)
    dropped += final.dropped_events_total
    stats = m.stats()
    # Close flushed the events of iteration 2000 too: ids 0..4001 arrive, 4002.. are dropped.
    assert [e.event_id for e in received] == list(range(4002))
    assert dropped == stats.events_dropped_total == stats.events_enqueued_total - 4002 == 1998
    assert stats.pending_iterations == 0


# ---- the worker's hand-off ------------------------------------------------------------------


def test_an_idle_worker_parks_and_the_next_flush_wakes_it(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvevents.producer import _worker

    monkeypatch.setattr(_worker, "PARK_AFTER_IDLE_S", 0.005)  # park after 5 empty polls
    with KVCacheEventManager(10) as m:
        deadline = time.monotonic() + 5
        while not m._worker.parked and time.monotonic() < deadline:
            time.sleep(0.005)
        assert m._worker.parked
        for i in range(3):  # parks again between the flushes, woken each time
            m.enqueue_removed_event(i, W)
            m.flush()
            assert [e.event_id for e in m.get_events(timeout=5)] == [i]
            time.sleep(0.05)
            assert m._worker.parked


def test_a_failure_while_building_is_counted_and_the_worker_survives(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from kvevents.producer import _worker

    failures = iter([True])
    real_removed = _worker.KVCacheRemovedData

    def flaky(block_hashes: list[int]) -> KVCacheRemovedData:
        if next(failures, False):
            raise RuntimeError("boom")
        return real_removed(block_hashes)

    monkeypatch.setattr(_worker, "KVCacheRemovedData", flaky)
    with KVCacheEventManager(10) as m, caplog.at_level(logging.ERROR, logger="kvevents.producer._worker"):
        m.enqueue_removed_event(1, 16)
        m.enqueue_removed_event(2, 32)
        m.flush()
        assert m.settle(5)
        assert m.get_events(timeout=0) == []
        assert m.stats().buffer.events_dropped_by_window_size == {16: 1, 32: 1}
        assert m.stats().events_flushed_by_type["removed"] == 2
        m.enqueue_removed_event(3, 16)
        m.flush()
        assert [e.event_id for e in delivered(m)] == [2]
    assert any("counted as dropped" in r.getMessage() for r in caplog.records)


def test_drained_events_and_drops_make_a_batch_that_round_trips_through_the_codec() -> None:
    # What the Kafka sink will do with a drain: the manager's objects are valid wire values.
    from kvevents.schemas import EventBatch, decode_batch, encode_batch

    u64_max = (1 << 64) - 1
    with KVCacheEventManager(
        3, attention_dp_rank=0, attention_dp_size=2, drop_warning_interval_s=3600, attention_dp_gather=False
    ) as m:
        m.enqueue_created_event([100, 20], W)
        blocks = [
            BlockInfo(
                u64_max, 5, [1, 2, 3], lora_id=9, token_extra_ids=[0, u64_max, 1], mm_keys=[(b"k" * 32, 0)]
            ),
            BlockInfo(7, u64_max, [4, 5, 6], is_primary=False, priority=90, cache_salt="salt"),
        ]
        m.enqueue_stored_event(blocks, W)
        m.enqueue_removed_event(u64_max, W)
        m.enqueue_removed_event(0, W)
        for i in range(5):
            m.enqueue_updated_event(KVCacheUpdatedData(i, priority=KVCacheEventDiff(35, 36)), 64)
        m.flush()
        assert m.settle(5)
        drain = m.drain(timeout=0)
    assert drain.dropped == [RankDrops(0, 2)]  # 8 events, capacity 3 x 2
    batch = EventBatch("engine-a", drain.events, attention_dp_size=2, dropped=drain.dropped)
    assert decode_batch(encode_batch(batch)) == batch


def test_a_new_manager_s_worker_starts_parked_and_the_first_flush_wakes_it() -> None:
    # No polling before the first event (the default parks only after 1 s without work).
    with KVCacheEventManager(10) as m:
        deadline = time.monotonic() + 0.5
        while not m._worker.parked and time.monotonic() < deadline:
            time.sleep(0.005)
        assert m._worker.parked
        m.enqueue_removed_event(1, W)
        m.flush()
        assert [e.event_id for e in m.get_events(timeout=5)] == [0]
