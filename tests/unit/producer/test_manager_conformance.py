"""Conformance of KVCacheEventManager to TensorRT-LLM's C++ manager, one behaviour per test.

Each test names the C++ function it pins, with line numbers in
``/work/shared/seed/kvCacheEventManager.cpp``, so a reader can walk the C++ top to bottom and
find the test for every line that has observable behaviour. The attention-DP exchange
(``exchangeAttentionDpThread``, L166-231) belongs to the gather and is tested there; only the
rank stamped on each event (L85, L108, L121, L127) is pinned here.

Where the port deliberately differs (drops counted, ``close()`` loses nothing), the test says so.

``settle()`` (not in the C++) waits until the worker has buffered what was flushed, so a test can
look at the buffer without sleeping.
"""

from __future__ import annotations

import threading
import time

import pytest
from kvevents.producer import BlockInfo, KVCacheEventManager
from kvevents.schemas import (
    KVCacheCreatedData,
    KVCacheEvent,
    KVCacheEventDiff,
    KVCacheRemovedData,
    KVCacheStoredBlockData,
    KVCacheStoredData,
    KVCacheUpdatedData,
)

W = 32  # a window size

# Every test runs on the compiled engine path and on the pure-Python one (see conftest.py).
pytestmark = pytest.mark.usefixtures("recorder_impl")


@pytest.fixture
def manager():  # type: ignore[no-untyped-def]
    with KVCacheEventManager(100) as m:
        yield m


def delivered(m: KVCacheEventManager) -> list[KVCacheEvent]:
    """Everything flushed so far, once the worker has buffered it."""
    assert m.settle(5)
    return m.get_events(timeout=0)


def chain(n: int, first_hash: int = 1, parent: int | None = None) -> list[BlockInfo]:
    blocks = []
    prev = parent
    for i in range(n):
        blocks.append(BlockInfo(first_hash + i, prev, [10 * i, 10 * i + 1]))
        prev = first_hash + i
    return blocks


# ---- constructor: KVCacheEventManager::KVCacheEventManager, L29-66 -------------------------


@pytest.mark.parametrize("max_entries", [0, -1])
def test_ctor_L38_max_kv_event_entries_must_be_positive(max_entries: int) -> None:
    # TLLM_CHECK(mMaxSize > 0);
    with pytest.raises(ValueError, match="max_kv_event_entries"):
        KVCacheEventManager(max_entries)


def test_ctor_L41_42_dp_rank_needs_dp_size() -> None:
    with pytest.raises(
        ValueError, match="If attention DP rank is set, the attention DP size must also be set"
    ):
        KVCacheEventManager(10, attention_dp_rank=0)


@pytest.mark.parametrize(("rank", "size"), [(2, 2), (3, 2)])
def test_ctor_L43_44_dp_rank_must_be_less_than_dp_size(rank: int, size: int) -> None:
    with pytest.raises(ValueError, match="Attention DP rank must be less than attention DP size"):
        KVCacheEventManager(10, attention_dp_rank=rank, attention_dp_size=size)


def test_ctor_L56_57_dp_size_without_dp_rank_is_an_error() -> None:
    with pytest.raises(
        ValueError, match="If attention DP rank is not set, the attention DP size must not be set"
    ):
        KVCacheEventManager(10, attention_dp_size=2)


def test_ctor_L45_50_rank_0_capacity_is_max_times_dp_size() -> None:
    # mMaxSize *= mAttentionDpSize.value() on rank 0 only: it holds max x size events.
    with KVCacheEventManager(3, attention_dp_rank=0, attention_dp_size=4, attention_dp_gather=False) as m:
        assert m.capacity == 12
        for i in range(12):
            m.enqueue_removed_event(i, window_size=W + i)  # distinct windows: 12 events
        m.flush()
        assert len(delivered(m)) == 12
        assert m.stats().buffer.events_dropped_total == 0


def test_ctor_L45_50_other_ranks_and_no_dp_keep_max_as_capacity() -> None:
    with KVCacheEventManager(3, attention_dp_rank=1, attention_dp_size=4, attention_dp_gather=False) as m:
        assert m.capacity == 3
    with KVCacheEventManager(3) as m:
        assert m.capacity == 3


def test_ctor_L32_36_keeps_its_configuration() -> None:
    with KVCacheEventManager(7, 1, 2, 9, attention_dp_gather=False) as m:
        assert (m.max_kv_event_entries, m.attention_dp_rank, m.attention_dp_size) == (7, 1, 2)
        assert m.attention_dp_events_gather_period_ms == 9
    with KVCacheEventManager(7) as m:
        assert m.attention_dp_events_gather_period_ms == 5  # the C++ default


def test_ctor_L59_starts_the_worker(manager: KVCacheEventManager) -> None:
    # mWorkerThread = std::thread(worker): flushed events reach the buffer with no other call.
    manager.enqueue_removed_event(1, W)
    manager.flush()
    assert [e.event_id for e in manager.get_events(timeout=5)] == [0]


# ---- event ids: mEventId{0} (L33), mEventId++ in every enqueue* ----------------------------


def test_L33_event_ids_start_at_0_and_increase_by_one_per_event(manager: KVCacheEventManager) -> None:
    manager.enqueue_created_event([10], W)
    manager.enqueue_stored_event(chain(1), W)
    manager.enqueue_removed_event(1, W)
    manager.enqueue_updated_event(KVCacheUpdatedData(1), W)
    manager.flush()
    manager.enqueue_removed_event(2, W)
    manager.flush()
    assert [e.event_id for e in delivered(manager)] == [0, 1, 2, 3, 4]


# ---- the rank stamped on every event: mAttentionDpRank in L85, L108, L121, L127 -------------


def test_events_carry_the_attention_dp_rank_or_none() -> None:
    for rank, size in [(None, None), (0, 2), (1, 2)]:
        with KVCacheEventManager(10, rank, size, attention_dp_gather=False) as m:
            m.enqueue_created_event([1], W)
            m.enqueue_stored_event(chain(1), W)
            m.enqueue_removed_event(1, W)
            m.enqueue_updated_event(KVCacheUpdatedData(1), W)
            m.flush()
            assert [e.attention_dp_rank for e in delivered(m)] == [rank] * 4


# ---- enqueueCreatedEvent, L82-86 ----------------------------------------------------------


def test_created_L85_carries_blocks_per_cache_level_and_window(manager: KVCacheEventManager) -> None:
    levels = [1000, 200]
    manager.enqueue_created_event(levels, 64)
    levels.append(5)  # the C++ copies the vector: later changes by the engine do not leak in
    manager.flush()
    assert delivered(manager) == [KVCacheEvent(0, KVCacheCreatedData([1000, 200]), 64)]


# ---- enqueueStoredEvent, L88-109 ----------------------------------------------------------


def test_stored_L90_93_no_blocks_is_a_no_op_and_takes_no_id(manager: KVCacheEventManager) -> None:
    manager.enqueue_stored_event([], W)
    manager.flush()
    manager.enqueue_removed_event(5, W)
    manager.flush()
    events = delivered(manager)
    assert [(e.event_id, e.data) for e in events] == [(0, KVCacheRemovedData([5]))]
    assert manager.stats().events_enqueued_total == 1


def test_stored_L95_98_parent_is_the_first_blocks_previous_block(manager: KVCacheEventManager) -> None:
    manager.enqueue_stored_event(chain(3, first_hash=11, parent=10), W)
    manager.flush()
    (event,) = delivered(manager)
    assert event.data.parent_hash == 10  # type: ignore[union-attr]


def test_stored_L95_98_no_parent_at_the_root(manager: KVCacheEventManager) -> None:
    manager.enqueue_stored_event(chain(2, parent=None), W)
    manager.flush()
    (event,) = delivered(manager)
    assert event.data.parent_hash is None  # type: ignore[union-attr]


def test_stored_L95_only_the_first_blocks_previous_block_matters(manager: KVCacheEventManager) -> None:
    # blocks.front()->getPrevBlock(): the others' previous blocks are not looked at.
    blocks = [BlockInfo(5, 4, [1]), BlockInfo(6, 999, [2])]
    manager.enqueue_stored_event(blocks, W)
    manager.flush()
    (event,) = delivered(manager)
    assert event.data.parent_hash == 4  # type: ignore[union-attr]
    assert [b.block_hash for b in event.data.blocks] == [5, 6]  # type: ignore[union-attr]


def test_stored_L102_106_each_block_keeps_all_its_attributes(manager: KVCacheEventManager) -> None:
    # emplace_back(hash, uniqueTokens, loraTaskId, isPrimary ? kPrimaryLevel : kSecondaryLevel,
    #              priority, extraKeys) -- plus the newer mm_keys and cache_salt.
    mm = b"m" * 32
    first = BlockInfo(
        21,
        20,
        [1, 2, 3],
        lora_id=7,
        is_primary=True,
        priority=80,
        token_extra_ids=[0, 9, 0],
        mm_keys=[(mm, 1)],
        cache_salt="salt",
    )
    second = BlockInfo(22, 21, [4, 5, 6], is_primary=False, priority=0)
    manager.enqueue_stored_event([first, second], 128)
    manager.flush()
    (event,) = delivered(manager)
    assert event == KVCacheEvent(
        0,
        KVCacheStoredData(
            20,
            [
                KVCacheStoredBlockData(21, [1, 2, 3], 7, 0, 80, [0, 9, 0], ((mm, 1),), "salt"),
                KVCacheStoredBlockData(22, [4, 5, 6], None, 1, 0, None, (), None),
            ],
        ),
        128,
    )


def test_stored_L100_106_engine_reusing_its_list_does_not_change_the_event(
    manager: KVCacheEventManager,
) -> None:
    # The C++ copies each block's data at enqueue time.
    blocks = chain(2)
    manager.enqueue_stored_event(blocks, W)
    blocks.append(BlockInfo(99, 2, [0]))
    blocks[0] = BlockInfo(98, None, [0])
    manager.flush()
    (event,) = delivered(manager)
    assert [b.block_hash for b in event.data.blocks] == [1, 2]  # type: ignore[union-attr]


# ---- enqueueRemovedEvent, L111-123 --------------------------------------------------------


def test_removed_L114_117_same_window_merges_into_the_last_removed_event_without_an_id(
    manager: KVCacheEventManager,
) -> None:
    for block_hash in (7, 8, 9):
        manager.enqueue_removed_event(block_hash, W)
    manager.enqueue_created_event([1], W)  # takes the next id: 1, not 3
    manager.flush()
    assert [(e.event_id, e.data) for e in delivered(manager)] == [
        (0, KVCacheRemovedData([7, 8, 9])),
        (1, KVCacheCreatedData([1])),
    ]


def test_removed_L114_another_window_starts_a_new_removed_event(manager: KVCacheEventManager) -> None:
    manager.enqueue_removed_event(1, 32)
    manager.enqueue_removed_event(2, 64)
    manager.enqueue_removed_event(3, 32)  # the LAST queued event has window 64: no merge
    manager.flush()
    assert [(e.event_id, e.window_size, e.data) for e in delivered(manager)] == [
        (0, 32, KVCacheRemovedData([1])),
        (1, 64, KVCacheRemovedData([2])),
        (2, 32, KVCacheRemovedData([3])),
    ]


@pytest.mark.parametrize("kind", ["created", "stored", "updated"])
def test_removed_L115_only_merges_when_the_last_event_is_a_removed_one(
    manager: KVCacheEventManager, kind: str
) -> None:
    manager.enqueue_removed_event(1, W)
    if kind == "created":
        manager.enqueue_created_event([1], W)
    elif kind == "stored":
        manager.enqueue_stored_event(chain(1), W)
    else:
        manager.enqueue_updated_event(KVCacheUpdatedData(1), W)
    manager.enqueue_removed_event(2, W)
    manager.flush()
    events = delivered(manager)
    assert [e.event_id for e in events] == [0, 1, 2]
    assert events[0].data == KVCacheRemovedData([1])
    assert events[2].data == KVCacheRemovedData([2])


def test_removed_L114_L154_no_merge_across_a_flush(manager: KVCacheEventManager) -> None:
    # flush() empties mEventQueue, so the next Removed event has nothing to merge into.
    manager.enqueue_removed_event(1, W)
    manager.flush()
    manager.enqueue_removed_event(2, W)
    manager.flush()
    assert [(e.event_id, e.data) for e in delivered(manager)] == [
        (0, KVCacheRemovedData([1])),
        (1, KVCacheRemovedData([2])),
    ]


# ---- enqueueUpdatedEvent, L125-128 --------------------------------------------------------


def test_updated_L127_carries_the_data_unchanged(manager: KVCacheEventManager) -> None:
    data = KVCacheUpdatedData(5, cache_level=KVCacheEventDiff(0, 1), priority=KVCacheEventDiff(35, 90))
    manager.enqueue_updated_event(data, 16)
    manager.flush()
    assert delivered(manager) == [KVCacheEvent(0, data, 16)]


# ---- flush, L152-164 ----------------------------------------------------------------------


def test_flush_L154_events_are_invisible_until_flushed(manager: KVCacheEventManager) -> None:
    manager.enqueue_removed_event(1, W)
    assert manager.settle(5)
    assert manager.get_events(timeout=0.05) == []
    manager.flush()
    assert len(manager.get_events(timeout=5)) == 1


def test_flush_L156_159_empty_flush_is_a_no_op(manager: KVCacheEventManager) -> None:
    manager.flush()
    manager.flush()
    assert manager.stats().iterations_flushed_total == 0
    assert manager.get_events(timeout=0.05) == []


def test_flush_L161_163_each_flush_hands_one_iteration_in_order(manager: KVCacheEventManager) -> None:
    for i in range(5):
        manager.enqueue_updated_event(KVCacheUpdatedData(i), W)
        manager.flush()
    assert [e.data.block_hash for e in delivered(manager)] == [0, 1, 2, 3, 4]  # type: ignore[union-attr]
    assert manager.stats().iterations_flushed_total == 5


# ---- getEvents, L135-150 ------------------------------------------------------------------


def test_get_events_L146_without_timeout_waits_until_events_arrive(manager: KVCacheEventManager) -> None:
    got: list[list[KVCacheEvent]] = []
    reader = threading.Thread(target=lambda: got.append(manager.get_events()))
    reader.start()
    time.sleep(0.1)
    assert reader.is_alive()  # still waiting: nothing flushed
    manager.enqueue_removed_event(1, W)
    manager.flush()
    reader.join(5)
    assert [[e.event_id for e in batch] for batch in got] == [[0]]


def test_get_events_L142_timeout_returns_empty_when_nothing_came(manager: KVCacheEventManager) -> None:
    start = time.monotonic()
    assert manager.get_events(timeout=0.1) == []
    assert time.monotonic() - start >= 0.09


def test_get_events_L149_returns_all_buffered_events_and_clears_them(manager: KVCacheEventManager) -> None:
    manager.enqueue_removed_event(1, 16)
    manager.enqueue_removed_event(2, 32)
    manager.flush()
    assert manager.settle(5)
    assert [e.event_id for e in manager.get_events(timeout=0)] == [0, 1]
    assert manager.get_events(timeout=0) == []


def test_get_events_L138_returns_at_once_when_closed() -> None:
    m = KVCacheEventManager(10)
    m.close()
    start = time.monotonic()
    assert m.get_events() == []  # no timeout, yet returns: !mRun
    assert time.monotonic() - start < 1


# ---- worker, L233-269: appending and truncation -----------------------------------------------


def test_worker_L264_appends_iterations_after_what_is_buffered(manager: KVCacheEventManager) -> None:
    manager.enqueue_removed_event(1, 16)
    manager.flush()
    assert manager.settle(5)
    manager.enqueue_removed_event(2, 32)
    manager.flush()
    assert [e.event_id for e in delivered(manager)] == [0, 1]


def test_worker_L252_255_exactly_at_capacity_nothing_is_dropped() -> None:
    # elementsToRemove == 0: no removal (and, unlike the C++ with a negative size_t
    # difference, no wraparound arithmetic is involved at all).
    with KVCacheEventManager(3) as m:
        m.enqueue_removed_event(1, 16)
        m.flush()
        m.enqueue_removed_event(2, 32)
        m.enqueue_removed_event(3, 16)
        m.flush()
        assert [e.event_id for e in delivered(m)] == [0, 1, 2]
        assert m.stats().buffer.events_dropped_total == 0


def test_worker_L254_259_overflow_drops_the_oldest_buffered_events_first() -> None:
    with KVCacheEventManager(3) as m:
        for h, w in [(1, 16), (2, 32), (3, 16)]:
            m.enqueue_removed_event(h, w)
        m.flush()
        assert m.settle(5)
        m.enqueue_removed_event(4, 32)
        m.enqueue_removed_event(5, 16)
        m.flush()
        assert [e.event_id for e in delivered(m)] == [2, 3, 4]


def test_worker_L263_264_then_from_the_front_of_the_new_iteration() -> None:
    with KVCacheEventManager(3) as m:
        m.enqueue_removed_event(100, 64)
        m.flush()
        assert m.settle(5)
        for i in range(5):
            m.enqueue_updated_event(KVCacheUpdatedData(i), W)
        m.flush()
        # id 0 (buffered) goes first, then ids 1 and 2 from the front of the new iteration.
        assert [e.event_id for e in delivered(m)] == [3, 4, 5]


def test_worker_L260_overflow_is_logged(caplog: pytest.LogCaptureFixture) -> None:
    with KVCacheEventManager(1) as m, caplog.at_level("WARNING", logger="kvevents.producer.buffer"):
        m.enqueue_removed_event(1, 16)
        m.enqueue_removed_event(2, 32)
        m.flush()
        assert m.settle(5)
    assert any("The event queue has reached the max size of 1" in r.getMessage() for r in caplog.records)


# ---- destructor, L68-80 ---------------------------------------------------------------------


def test_close_L70_72_wakes_every_waiting_reader() -> None:
    m = KVCacheEventManager(10)
    results: list[list[KVCacheEvent]] = []
    readers = [threading.Thread(target=lambda: results.append(m.get_events())) for _ in range(4)]
    for r in readers:
        r.start()
    time.sleep(0.1)
    assert all(r.is_alive() for r in readers)
    m.close()
    for r in readers:
        r.join(5)
        assert not r.is_alive()
    assert results == [[]] * 4


def test_close_L73_stops_the_worker_thread() -> None:
    m = KVCacheEventManager(10)
    worker = m._worker.thread
    assert worker.is_alive()
    m.close()
    assert not worker.is_alive()


def test_close_is_idempotent_and_the_context_manager_closes() -> None:
    with KVCacheEventManager(10) as m:
        assert not m.closed
    assert m.closed
    m.close()
    m.close()
    assert not m._worker.thread.is_alive()


def test_close_deviation_flushed_and_unflushed_events_are_not_lost() -> None:
    # The C++ destructor makes the worker return with mPendingEvents unprocessed and drops
    # mEventQueue. Here close() buffers both, so nothing enqueued is lost at shutdown.
    m = KVCacheEventManager(10)
    m.enqueue_removed_event(1, 16)
    m.flush()
    m.enqueue_removed_event(2, 32)  # never flushed by the engine
    m.close()
    assert [e.event_id for e in m.get_events()] == [0, 1]
    assert m.stats().buffer.events_dropped_total == 0
