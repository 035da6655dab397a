"""A worker's restart (a Created event) drops its caches' blocks. The compiled core drops a
small cache's blocks from its own list of nodes (every node it was given since it was last
empty, up to 1,024 or a 256th of the index's nodes). A bigger cache's are found by a scan of
every node made before the index lock is taken for the batch, and the holders of the nodes
found are then dropped; a cache that gained blocks after that scan (an earlier event of the
same batch) is finished by a scan under the lock. Either way the index is the pure-Python
core's, event for event."""

from __future__ import annotations

import pytest
from _index_helpers import batch, created, removed, stored
from kvevents.consumer.index import CacheIndex
from kvevents.schemas import EventBatch, encode_batch

RANKS = 10
OWN = 1000
"""Blocks of a rank's own per cache in the big fleet: with the 100 shared, past the 1,024
nodes a cache's list holds, so its restart is planned."""
SMALL_OWN = 200


def both(batches: list[EventBatch]) -> tuple[CacheIndex, CacheIndex]:
    compiled, oracle = CacheIndex(core="compiled"), CacheIndex(core="python")
    for b in batches:
        compiled.apply_encoded(encode_batch(b))
        oracle.apply_encoded(encode_batch(b))
    assert compiled.to_bytes() == oracle.to_bytes()
    assert compiled.stats().counters == oracle.stats().counters
    return compiled, oracle


def fleet(own_blocks: int = OWN) -> list[EventBatch]:
    """Ten ranks, each with two window caches holding ``own_blocks`` + 100 blocks, the 100
    shared by all."""
    shared = list(range(1, 101))
    events = []
    for r in range(RANKS):
        events += [created(0, rank=r), created(1, window=128, rank=r)]
        own = [10**8 * (r + 1) + j for j in range(own_blocks)]
        events += [stored(2, shared + own, rank=r), stored(3, shared + own, window=128, rank=r)]
    return [batch(events, 0, dp=RANKS)]


def layout(index: CacheIndex) -> dict[str, int]:
    return index._core.store_layout()  # type: ignore[no-any-return]


def test_a_restart_drops_the_blocks_found_before_the_lock() -> None:
    restart = batch([created(4, rank=3), created(5, window=128, rank=3)], 1, dp=RANKS)
    compiled, _ = both([*fleet(), restart])
    assert layout(compiled)["clears_planned"] == 2  # both of rank 3's caches, from the plan
    assert layout(compiled)["clears_scanned"] == 0
    assert compiled.held_blocks() == 2 * (OWN + 100) * (RANKS - 1)
    assert compiled.find_matches(list(range(1, 101))) == {("i0", r): 100 for r in range(RANKS) if r != 3}


def test_a_small_cache_is_dropped_from_its_own_list_of_nodes() -> None:
    restart = batch([created(4, rank=3), created(5, window=128, rank=3)], 1, dp=RANKS)
    compiled, _ = both([*fleet(SMALL_OWN), restart])
    counts = layout(compiled)
    assert (counts["clears_listed"], counts["clears_planned"], counts["clears_scanned"]) == (2, 0, 0)
    assert counts["recent_bytes"] > 0
    assert compiled.held_blocks() == 2 * (SMALL_OWN + 100) * (RANKS - 1)
    assert compiled.find_matches(list(range(1, 101))) == {("i0", r): 100 for r in range(RANKS) if r != 3}


def test_restarts_of_a_small_cache_over_and_over_scan_nothing() -> None:
    """A producer restarting a cache of one block again and again (hostile, or broken) costs
    that block each time, not a pass over the index's every node."""
    events = []
    for k in range(200):
        events += [created(4 + 2 * k, rank=3), stored(5 + 2 * k, [9 * 10**6 + k], rank=3)]
    compiled, _ = both([*fleet(), batch(events, 1, dp=RANKS)])
    counts = layout(compiled)
    assert counts["clears_scanned"] == 0 and counts["clears_listed"] == 199
    assert counts["clears_planned"] == 2  # the first restart: both big window caches
    assert compiled.find_matches([9 * 10**6 + 199]) == {("i0", 3): 1}
    assert compiled.find_matches([9 * 10**6 + 198]) == {}


def test_a_cache_past_its_list_restarts_by_a_scan_until_it_is_empty_again() -> None:
    """Rank 3's caches outgrow their lists (1,100 blocks): a restart would be planned. Emptied
    by Removed events and one refilled with a few blocks, it has a complete list again."""
    held = list(range(1, 101)) + [10**8 * 4 + j for j in range(OWN)]
    emptied = [
        removed(4, held, rank=3),
        removed(5, held, window=128, rank=3),
        stored(6, [6 * 10**6, 6 * 10**6 + 1], rank=3),
    ]
    compiled, _ = both([*fleet(), batch(emptied, 1, dp=RANKS), batch([created(7, rank=3)], 2, dp=RANKS)])
    assert (layout(compiled)["clears_listed"], layout(compiled)["clears_planned"]) == (1, 0)
    assert compiled.find_matches([6 * 10**6]) == {}


def test_a_list_of_nodes_mostly_let_go_is_compacted_not_given_up() -> None:
    """Rank 3 stores and removes block after block, keeping one in eight: its list reaches
    its limit with most of its nodes let go, keeps the ones still held and stays complete."""
    events, eid = [], 4
    for k in range(3000):
        events.append(stored(eid, [7 * 10**6 + k], rank=3))
        eid += 1
        if k % 8 != 0:
            events.append(removed(eid, [7 * 10**6 + k], rank=3))
            eid += 1
    kept = [7 * 10**6 + k for k in range(0, 3000, 8)]
    compiled, _ = both(
        [*fleet(SMALL_OWN), batch(events, 1, dp=RANKS), batch([created(eid, rank=3)], 2, dp=RANKS)]
    )
    counts = layout(compiled)
    assert (counts["clears_listed"], counts["clears_planned"], counts["clears_scanned"]) == (2, 0, 0)
    assert all(compiled.find_matches([h]) == {} for h in kept[::50])


@pytest.mark.parametrize(("own_blocks", "listed", "planned"), [(SMALL_OWN, 2, 0), (OWN, 0, 2)])
def test_an_imported_state_has_the_lists_its_stores_made(own_blocks: int, listed: int, planned: int) -> None:
    """A checkpoint's import lists each cache's nodes as its stores did (the same lists, so a
    restart after a warm start scans nothing for a small cache); a cache past its list's limit
    is planned, as without the import. The index stays the oracle's."""
    compiled, oracle = both(fleet(own_blocks))
    restored = CacheIndex.from_bytes(compiled.to_bytes(), core="compiled")
    assert layout(restored)["recent_bytes"] == layout(compiled)["recent_bytes"]
    assert (layout(restored)["recent_bytes"] > 0) == (listed > 0)
    restart = batch([created(4, rank=3)], 1, dp=RANKS)
    for index in (restored, oracle):
        index.apply_encoded(encode_batch(restart))
    assert restored.to_bytes() == oracle.to_bytes()
    counts = layout(restored)
    clears = (counts["clears_listed"], counts["clears_planned"], counts["clears_scanned"])
    assert clears == (listed, planned, 0)


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


@pytest.mark.parametrize("own_blocks", [OWN, SMALL_OWN])
@pytest.mark.parametrize("twice", [False, True])
def test_a_node_released_and_reused_between_plan_and_clear(twice: bool, own_blocks: int) -> None:
    """The batch first removes rank 3's shared blocks' holders elsewhere and stores new blocks
    on released nodes, then restarts rank 3: the plan's node ids (or the cache's list's) may
    now hold other blocks."""
    events = [removed(4, list(range(1, 101)), rank=r) for r in range(RANKS) if r != 3]
    events += [stored(5, [7 * 10**6 + j for j in range(100)], rank=0)]
    events += [created(6, rank=3)]
    if twice:
        events += [stored(7, [8 * 10**6 + j for j in range(20)], rank=3), created(8, rank=3)]
    compiled, _ = both([*fleet(own_blocks), batch(events, 1, dp=RANKS)])
    assert compiled.find_matches([8 * 10**6]) == {}


@pytest.mark.parametrize(("own_blocks", "listed", "planned"), [(OWN, 0, 2), (SMALL_OWN, 2, 0)])
def test_reset_worker_drops_the_blocks_found_before_the_lock(
    own_blocks: int, listed: int, planned: int
) -> None:
    """reset_worker (liveness, snapshots) finds the worker's blocks the same way (from the
    caches' lists when small, else by a scan before the lock), then drops them as the
    pure-Python core does."""
    compiled, oracle = both(fleet(own_blocks))
    for index in (compiled, oracle):
        index.reset_worker(("i0", 3), clear_degraded=True)  # type: ignore[arg-type]
    assert compiled.to_bytes() == oracle.to_bytes()
    assert compiled.stats().counters == oracle.stats().counters
    counts = layout(compiled)
    assert (counts["clears_listed"], counts["clears_planned"], counts["clears_scanned"]) == (
        listed,
        planned,
        0,
    )
    assert compiled.held_blocks() == 2 * (own_blocks + 100) * (RANKS - 1)


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


def test_a_cache_list_stays_near_what_the_cache_holds() -> None:
    """A cache holding one block while 5,000 others come and go (a churning, or hostile,
    producer) keeps a list of a few nodes, not one per store: the lists' memory follows what
    the caches hold."""
    events = [created(0), stored(1, [1])]
    for k in range(5000):
        events += [stored(2 + 2 * k, [10**6 + k]), removed(3 + 2 * k, [10**6 + k])]
    compiled, _ = both([batch(events, 0), batch([created(10**5)], 1)])
    counts = layout(compiled)
    assert counts["recent_bytes"] <= 32 * 4  # 16 entries, or 32 at most
    assert counts["clears_listed"] == 1 and compiled.held_blocks() == 0


def test_the_pure_core_keeps_each_cache_s_held_nodes_as_its_holders_say() -> None:
    """The pure-Python core drops a restarted cache's blocks from the cache's own set of held
    nodes (no scan of every node): after stores, removals, restarts and an import, each set is
    exactly the nodes that list the cache as a holder."""
    batches = fleet(SMALL_OWN)
    batches.append(
        batch([removed(4, [5, 6, 10**8 + 3]), created(4, rank=1), stored(5, [5, 7], rank=1)], 1, dp=RANKS)
    )
    _, oracle = both(batches)
    restored = CacheIndex.from_bytes(oracle.to_bytes(), core="python")
    for index in (oracle, restored):
        core = index._core
        for slot_id, slot in enumerate(core._slots):
            holding = {e for e, node in core._nodes.items() if slot_id in node.holders}
            assert slot.held == holding, slot_id
        assert sum(len(s.held) for s in core._slots) == index.held_blocks() > 0
        assert core._slots[2].held == {5, 7}  # rank 1's first cache: restarted, then two blocks
