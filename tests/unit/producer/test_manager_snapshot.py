"""Producer snapshots on the manager: chains, event order and ids, and when one is requested."""

from __future__ import annotations

import itertools
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kvevents.producer import BlockInfo, KVCacheEventManager, snapshot_chains
from kvevents.schemas import KVCacheCreatedData, KVCacheEventDiff, KVCacheStoredData, KVCacheUpdatedData

WINDOW = 64

# Every test runs on the compiled engine path and on the pure-Python one (see conftest.py).
pytestmark = pytest.mark.usefixtures("recorder_impl")


def info(h: int, prev: int | None, primary: bool = True, priority: int = 35) -> BlockInfo:
    return BlockInfo(h, prev, [h % 1000, 7], is_primary=primary, priority=priority)


@st.composite
def forests(draw: st.DrawFn) -> list[BlockInfo]:
    """Random prefix trees, with orphans (a parent that is not held), shuffled."""
    n = draw(st.integers(0, 60))
    blocks: list[BlockInfo] = []
    for h in range(1, n + 1):
        kind = draw(st.sampled_from(["root", "child", "child", "child", "orphan"]))
        if kind == "child" and blocks:
            parent: int | None = draw(st.sampled_from(blocks)).block_hash
        elif kind == "orphan":
            parent = 10_000 + h
        else:
            parent = None
        blocks.append(info(h, parent))
    random.Random(draw(st.integers(0, 2**32))).shuffle(blocks)
    return blocks


@settings(max_examples=200)
@given(forests())
def test_chains_cover_every_block_once_parents_first(blocks: list[BlockInfo]) -> None:
    chains = snapshot_chains(blocks)
    flat = [b for chain in chains for b in chain]
    assert sorted(b.block_hash for b in flat) == sorted(b.block_hash for b in blocks)
    held = {b.block_hash for b in blocks}
    seen: set[int] = set()
    for chain in chains:
        first = chain[0]
        # a chain starts at a root, an orphan, or a child of a block placed before it
        assert (
            first.prev_block_hash is None
            or first.prev_block_hash not in held
            or first.prev_block_hash in seen
        )
        for parent, child in itertools.pairwise(chain):
            assert child.prev_block_hash == parent.block_hash
        seen.update(b.block_hash for b in chain)
    # one chain per root or orphan, plus one per child that is not its parent's first child
    children: dict[int, int] = {}
    for b in blocks:
        if b.prev_block_hash in held:
            children[b.prev_block_hash] = children.get(b.prev_block_hash, 0) + 1
    starts = sum(1 for b in blocks if b.prev_block_hash not in held)
    assert len(chains) == starts + sum(k - 1 for k in children.values())


def test_long_chains_do_not_recurse() -> None:
    blocks = [info(h, h - 1 if h > 1 else None) for h in range(1, 50_001)]
    assert [len(c) for c in snapshot_chains(reversed(blocks))] == [50_000]


def test_duplicates_and_cycles_are_errors() -> None:
    with pytest.raises(ValueError, match="given twice"):
        snapshot_chains([info(1, None), info(1, None)])
    with pytest.raises(ValueError, match="cycle"):
        snapshot_chains([info(1, None), info(2, 3), info(3, 2)])


def test_enqueue_snapshot_queues_created_for_every_window_then_chains() -> None:
    with KVCacheEventManager(100) as manager:
        manager.enqueue_created_event([10, 5], WINDOW)
        summary = manager.enqueue_snapshot(
            {WINDOW: [info(2, 1, primary=False, priority=80), info(1, None), info(3, 1)], 128: []},
            {WINDOW: [10, 5], 128: [4, 0], 256: [1, 1]},
        )
        manager.flush()
        assert manager.settle(5)
        events = manager.get_events(0)
    assert (summary.first_event_id, summary.last_event_id, summary.windows) == (1, 5, (WINDOW, 128, 256))
    assert (summary.stored_events, summary.blocks, summary.events) == (2, 3, 5)
    assert [e.event_id for e in events] == [0, 1, 2, 3, 4, 5]
    created = [(e.window_size, e.data) for e in events[1:4]]
    assert created == [
        (WINDOW, KVCacheCreatedData([10, 5], snapshot=True)),
        (128, KVCacheCreatedData([4, 0], snapshot=True)),
        (256, KVCacheCreatedData([1, 1], snapshot=True)),
    ]
    first, second = events[4].data, events[5].data
    assert isinstance(first, KVCacheStoredData) and isinstance(second, KVCacheStoredData)
    assert first.parent_hash is None and [b.block_hash for b in first.blocks] == [1, 2]
    assert (first.blocks[1].cache_level, first.blocks[1].priority) == (1, 80)
    assert second.parent_hash == 1 and [b.block_hash for b in second.blocks] == [3]
    assert manager.stats().snapshots_published_total == 1


def test_one_capacity_list_serves_every_window_and_missing_capacity_is_an_error() -> None:
    with KVCacheEventManager(100) as manager:
        summary = manager.enqueue_snapshot({WINDOW: [info(1, None)], 128: [info(1, None)]}, [8, 0])
        assert summary.windows == (WINDOW, 128) and summary.events == 4
        with pytest.raises(ValueError, match="no capacity for window sizes \\[128\\]"):
            manager.enqueue_snapshot({WINDOW: [], 128: []}, {WINDOW: [1]})
        with pytest.raises(ValueError, match="window_size"):
            manager.enqueue_snapshot({0: []}, [1])
        assert manager.stats().events_enqueued_total == 4  # the failed calls queued nothing


def test_a_snapshot_larger_than_the_buffer_is_refused_whole() -> None:
    with KVCacheEventManager(3) as manager:
        with pytest.raises(ValueError, match="cannot fit the event buffer \\(capacity 3\\)"):
            manager.enqueue_snapshot({WINDOW: [info(1, None), info(2, None), info(3, None)]}, [4])
        assert manager.stats().events_enqueued_total == 0


def overflow(manager: KVCacheEventManager, events: int) -> None:
    for i in range(events):
        manager.enqueue_removed_event(i, WINDOW)
        manager.enqueue_updated_event(_updated(i), WINDOW)  # not merged: one event each
    manager.flush()
    assert manager.settle(5)


def _updated(h: int) -> KVCacheUpdatedData:
    return KVCacheUpdatedData(h, priority=KVCacheEventDiff(35, 40))


def test_drops_of_its_own_rank_request_a_snapshot_once_until_published() -> None:
    reasons: list[str] = []
    with KVCacheEventManager(4) as manager:
        manager.add_snapshot_listener(reasons.append)
        assert not manager.snapshot_requested
        overflow(manager, 3)  # 6 events into 4 places
        assert manager.snapshot_requested and len(reasons) == 1
        assert "events of attention-DP rank 0 dropped" in reasons[0]
        overflow(manager, 3)
        assert len(reasons) == 1 and manager.stats().snapshot_requests_total >= 2
        manager.get_events(0)
        manager.enqueue_snapshot({WINDOW: []}, [4])
        assert not manager.snapshot_requested and manager.snapshot_request_reason is None
        manager.flush()
        assert manager.settle(5)
        assert not manager.snapshot_requested  # the snapshot (1 event) fits
        overflow(manager, 2)  # 4 more: the snapshot's Created is dropped -> asked again
        assert manager.snapshot_requested and len(reasons) == 2
        assert manager.stats().snapshot_requested


def test_drops_older_than_the_latest_snapshot_do_not_ask_again() -> None:
    with KVCacheEventManager(4) as manager:
        for i in range(6):
            manager.enqueue_removed_event(i, WINDOW)
            manager.enqueue_updated_event(_updated(i), WINDOW)
        # the snapshot is queued before the worker drops the older events of this iteration
        manager.enqueue_snapshot({WINDOW: []}, [4])
        manager.flush()
        assert manager.settle(5)
        events = manager.get_events(0)
        assert manager.stats().events_dropped_total == 9 and len(events) == 4
        assert isinstance(events[-1].data, KVCacheCreatedData) and events[-1].data.snapshot
        assert not manager.snapshot_requested


def test_drops_of_another_rank_in_rank_zeros_buffer_do_not_ask_this_engine() -> None:
    with KVCacheEventManager(2) as manager:  # rank 0: rank 1's drops reach it through the gather
        manager.buffer.record_drops(1, 5)
        assert not manager.snapshot_requested
        manager.buffer.record_drops(0, 1)
        assert manager.snapshot_requested


def test_request_snapshot_from_another_part_and_a_failing_listener() -> None:
    def broken(reason: str) -> None:
        raise RuntimeError("listener bug")

    with KVCacheEventManager(4) as manager:
        manager.add_snapshot_listener(broken)
        manager.request_snapshot("sink: 3 batches undeliverable")
        assert manager.snapshot_request_reason == "sink: 3 batches undeliverable"
        with pytest.raises(TypeError):
            manager.add_snapshot_listener("not callable")  # type: ignore[arg-type]
