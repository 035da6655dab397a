"""A worker's restart (a Created event) drops its caches' blocks. The compiled core finds them
by a scan of every node made before it takes the index lock for the batch, then drops the
holders of the nodes it found; a cache that gained blocks after that scan (an earlier event of
the same batch) is finished by a scan under the lock. Either way the index is the pure-Python
core's, event for event."""

from __future__ import annotations

import pytest
from _index_helpers import batch, created, removed, stored
from kvevents.consumer.index import CacheIndex
from kvevents.schemas import EventBatch, encode_batch

RANKS = 10


def both(batches: list[EventBatch]) -> tuple[CacheIndex, CacheIndex]:
    compiled, oracle = CacheIndex(core="compiled"), CacheIndex(core="python")
    for b in batches:
        compiled.apply_encoded(encode_batch(b))
        oracle.apply_encoded(encode_batch(b))
    assert compiled.to_bytes() == oracle.to_bytes()
    assert compiled.stats().counters == oracle.stats().counters
    return compiled, oracle


def fleet() -> list[EventBatch]:
    """Ten ranks, each with two window caches holding 300 blocks, 100 of them shared by all."""
    shared = list(range(1, 101))
    events = []
    for r in range(RANKS):
        events += [created(0, rank=r), created(1, window=128, rank=r)]
        own = [10**8 * (r + 1) + j for j in range(200)]
        events += [stored(2, shared + own, rank=r), stored(3, shared + own, window=128, rank=r)]
    return [batch(events, 0, dp=RANKS)]


def layout(index: CacheIndex) -> dict[str, int]:
    return index._core.store_layout()  # type: ignore[no-any-return]


def test_a_restart_drops_the_blocks_found_before_the_lock() -> None:
    restart = batch([created(4, rank=3), created(5, window=128, rank=3)], 1, dp=RANKS)
    compiled, _ = both([*fleet(), restart])
    assert layout(compiled)["clears_planned"] == 2  # both of rank 3's caches, from the plan
    assert layout(compiled)["clears_scanned"] == 0
    assert compiled.held_blocks() == 2 * 300 * (RANKS - 1)
    assert compiled.find_matches(list(range(1, 101))) == {("i0", r): 100 for r in range(RANKS) if r != 3}


def test_blocks_stored_after_the_plan_are_dropped_by_a_scan() -> None:
    """Rank 3 stores 50 new blocks, then restarts, in one batch: the plan (made before the
    batch) does not know the new blocks, so the cache is finished by a scan."""
    fresh = [5 * 10**6 + j for j in range(50)]
    restart = batch([stored(4, fresh, rank=3), created(5, rank=3)], 1, dp=RANKS)
    compiled, _ = both([*fleet(), restart])
    assert layout(compiled)["clears_scanned"] >= 1
    assert compiled.find_matches(fresh) == {}


def test_caches_past_what_a_plan_holds_are_each_scanned() -> None:
    """Ten ranks restart in one batch, two caches each: the first four ranks' eight caches are
    planned, the other twelve are scanned under the lock."""
    restart = batch([created(4 + r, rank=r) for r in range(RANKS)], 1, dp=RANKS)
    compiled, _ = both([*fleet(), restart])
    assert layout(compiled)["clears_planned"] == 8
    assert layout(compiled)["clears_scanned"] == 2 * RANKS - 8
    assert compiled.held_blocks() == 0


@pytest.mark.parametrize("twice", [False, True])
def test_a_node_released_and_reused_between_plan_and_clear(twice: bool) -> None:
    """The batch first removes rank 3's shared blocks' holders elsewhere and stores new blocks
    on released nodes, then restarts rank 3: the plan's node ids may now hold other blocks."""
    events = [removed(4, list(range(1, 101)), rank=r) for r in range(RANKS) if r != 3]
    events += [stored(5, [7 * 10**6 + j for j in range(100)], rank=0)]
    events += [created(6, rank=3)]
    if twice:
        events += [stored(7, [8 * 10**6 + j for j in range(20)], rank=3), created(8, rank=3)]
    compiled, _ = both([*fleet(), batch(events, 1, dp=RANKS)])
    assert compiled.find_matches([8 * 10**6]) == {}


def test_reset_worker_drops_the_blocks_found_before_the_lock() -> None:
    """reset_worker (liveness, snapshots) finds the worker's blocks the same way, then drops
    them as the pure-Python core does."""
    compiled, oracle = both(fleet())
    for index in (compiled, oracle):
        index.reset_worker(("i0", 3), clear_degraded=True)  # type: ignore[arg-type]
    assert compiled.to_bytes() == oracle.to_bytes()
    assert compiled.stats().counters == oracle.stats().counters
    assert (layout(compiled)["clears_planned"], layout(compiled)["clears_scanned"]) == (2, 0)
    assert compiled.held_blocks() == 2 * 300 * (RANKS - 1)


def test_reset_workers_plans_as_many_workers_per_scan_as_fit() -> None:
    """An instance's ten ranks reset at once (liveness: the instance closed): four ranks'
    caches per plan, none scanned under the lock; the index is the oracle's."""
    compiled, oracle = both(fleet())
    keys = [("i0", r) for r in range(RANKS)]
    for index in (compiled, oracle):
        index.reset_workers(keys, clear_degraded=True)  # type: ignore[arg-type]
    assert compiled.to_bytes() == oracle.to_bytes()
    assert compiled.stats().counters == oracle.stats().counters
    assert (layout(compiled)["clears_planned"], layout(compiled)["clears_scanned"]) == (2 * RANKS, 0)
    assert compiled.held_blocks() == 0
