"""Every rule of CacheIndex but the content rules (test_index_content_rules.py) and the loss and
producer-session rules (test_index_sessions.py), on both cores, fed model objects and real Avro bytes."""

from __future__ import annotations

import pytest
from _index_helpers import (
    BLOCK,
    W0,
    W1,
    WINDOW,
    batch,
    block,
    created,
    removed,
    stored,
    stored_blocks,
    tokens_for,
    updated,
)
from kvevents.consumer import CacheIndex, WorkerKey
from kvevents.schemas import KVCacheStoredData

# ---------------------------------------------------------------- Stored / Removed / Updated


def test_find_matches_counts_leading_blocks_held_contiguously(index, feed):
    feed(index, batch([created(0), stored(1, [1, 2, 3])], 0))
    assert index.find_matches([1, 2, 3]) == {W0: 3}
    assert index.find_matches([1, 2, 9, 3]) == {W0: 2}
    assert index.find_matches([2, 3]) == {W0: 2}
    assert index.find_matches([9, 1, 2]) == {}
    assert index.find_matches([]) == {}


def test_workers_are_scored_separately_and_zero_matches_are_omitted(index, feed):
    feed(
        index,
        batch(
            [
                created(0, rank=0),
                created(0, rank=1),
                created(0, rank=2),
                stored(1, [1, 2, 3], rank=0),
                stored(1, [1, 2], rank=1),
                stored(1, [5], rank=2),
            ],
            0,
            dp=3,
        ),
    )
    assert index.find_matches([1, 2, 3]) == {W0: 3, W1: 2}
    assert set(index.workers()) == {W0, W1, WorkerKey("i0", 2)}


def test_removed_deletes_blocks_of_that_worker_only(index, feed):
    feed(
        index,
        batch(
            [
                created(0, rank=0),
                created(0, rank=1),
                stored(1, [1, 2, 3], rank=0),
                stored(1, [1, 2, 3], rank=1),
                removed(2, [2], rank=0),
            ],
            0,
            dp=2,
        ),
    )
    assert index.find_matches([1, 2, 3]) == {W0: 1, W1: 3}
    assert [b.block_hash for b in index.worker_blocks(W0, WINDOW)] == [1, 3]
    assert index.stats().counters["blocks_removed"] == 1


def test_updated_moves_level_and_priority(index, feed):
    feed(index, batch([created(0), stored(1, [1, 2, 3]), updated(2, 2, level=(0, 1), priority=(35, 80))], 0))
    entries = {b.block_hash: b for b in index.worker_blocks(W0, WINDOW)}
    assert (entries[2].cache_level, entries[2].priority) == (1, 80)
    assert (entries[1].cache_level, entries[1].priority) == (0, 35)
    stats = index.worker_stats(W0)
    assert stats.windows[WINDOW].blocks_by_level == {0: 2, 1: 1}
    feed(index, batch([updated(3, 2, level=(1, 0))], 1))
    assert index.worker_stats(W0).windows[WINDOW].blocks_by_level == {0: 3}


def test_storing_a_held_block_again_updates_its_level(index, feed):
    feed(index, batch([created(0), stored(1, [1, 2]), stored(2, [2], parent=1, level=1)], 0))
    assert index.worker_stats(W0).windows[WINDOW].blocks_by_level == {0: 1, 1: 1}
    assert index.held_blocks() == 2


def test_unknown_removed_and_updated_are_counted_and_ignored(index, feed):
    feed(
        index,
        batch(
            [
                created(0),
                stored(1, [1]),
                removed(2, [9]),
                updated(3, 8, level=(0, 1)),
                removed(4, [1], window=WINDOW * 2),
            ],
            0,
        ),
    )
    counters = index.stats().counters
    assert (counters["unknown_removed"], counters["unknown_updated"]) == (2, 1)
    assert index.find_matches([1]) == {W0: 1}


def test_levels_and_priorities_saturate(index, feed):
    feed(
        index,
        batch([created(0), stored_blocks(1, [block(1, level=99, priority=999), block(2, priority=-5)])], 0),
    )
    entries = index.worker_blocks(W0, WINDOW)
    assert [(e.cache_level, e.priority) for e in entries] == [(15, 255), (0, 0)]


# ---------------------------------------------------------------- cache levels in matching


def test_secondary_blocks_count_by_default_stop_with_max_level_and_weigh_fractionally(index, feed):
    feed(
        index,
        batch(
            [
                created(0, rank=0),
                created(0, rank=1),
                stored(1, [1, 2, 3, 4], rank=0),
                stored(1, [1, 2, 3, 4], rank=1),
                updated(2, 2, level=(0, 1), rank=1),
            ],
            0,
            dp=2,
        ),
    )
    assert index.find_matches([1, 2, 3, 4]) == {W0: 4, W1: 4}
    assert index.find_matches([1, 2, 3, 4], max_cache_level=0) == {W0: 4, W1: 1}
    assert index.weighted_matches([1, 2, 3, 4], secondary_weight=0.25) == {W0: 4.0, W1: 3.25}
    details = index.match_details([1, 2, 3, 4])
    assert (details[W1].blocks, details[W1].primary_blocks, details[W1].secondary_blocks) == (4, 3, 1)
    by_tokens = index.find_matches_for_tokens(tokens_for([1, 2, 3, 4]), BLOCK, max_cache_level=0)
    assert by_tokens == {W0: 4, W1: 1}
    with pytest.raises(ValueError, match="secondary_weight"):
        index.weighted_matches([1], secondary_weight=2)
    with pytest.raises(ValueError, match="max_cache_level"):
        index.find_matches([1], max_cache_level=-1)


# ---------------------------------------------------------------- window sizes


def test_window_sizes_are_separate_caches(index, feed):
    feed(
        index,
        batch(
            [
                created(0, window=64),
                created(1, window=128),
                stored(2, [1, 2, 3], window=64),
                stored(3, [1, 2], window=128),
            ],
            0,
        ),
    )
    assert index.find_matches([1, 2, 3]) == {W0: 3}
    assert index.find_matches([1, 2, 3], window_size=128) == {W0: 2}
    assert index.find_matches([1, 2, 3], window_size=32) == {}
    assert {w: s.blocks for w, s in index.worker_stats(W0).windows.items()} == {64: 3, 128: 2}
    assert index.held_blocks() == 5


def test_created_run_resets_all_windows_then_builds_each(index, feed):
    feed(
        index,
        batch(
            [
                created(0, window=64),
                created(1, window=128),
                stored(2, [1], window=64),
                stored(3, [2], window=128),
            ],
            0,
        ),
    )
    # a Created directly after a Created keeps the window created just before
    feed(index, batch([created(4, window=64, levels=(7, 0)), created(5, window=32)], 1))
    stats = index.worker_stats(W0)
    assert sorted(stats.windows) == [32, 64]  # window 128 was not re-created: dropped
    assert stats.blocks == 0
    assert stats.windows[64].capacity == (7, 0)
    assert index.find_matches([1]) == {} and index.find_matches([2]) == {}


def test_created_after_other_events_drops_every_window(index, feed):
    feed(
        index,
        batch(
            [
                created(0, window=64),
                created(1, window=128),
                stored(2, [1], window=64),
                stored(3, [2], window=128),
                created(4, window=64),
            ],
            0,
        ),
    )
    assert sorted(index.worker_stats(W0).windows) == [64]
    assert index.held_blocks() == 0


def test_duplicate_created_in_a_run_empties_its_window(index, feed):
    feed(index, batch([created(0, window=64), created(1, window=64)], 0))
    assert index.worker_stats(W0).windows[64].blocks == 0


# ---------------------------------------------------------------- replays and duplicates


def test_applying_the_same_batch_twice_changes_nothing(index, feed):
    first = batch([created(0), stored(1, [1, 2, 3]), removed(2, [3]), updated(3, 2, level=(0, 1))], 0)
    feed(index, first)
    state = index.to_bytes()
    feed(index, first)
    assert index.to_bytes() == state
    counters = index.stats().counters
    assert counters["events_duplicate"] == 4 and counters["batches_replayed"] == 1


def test_old_events_in_a_new_batch_are_skipped(index, feed):
    feed(index, batch([created(0), stored(1, [1])], 0))
    feed(index, batch([stored(1, [1]), removed(1, [1]), stored(2, [2], parent=1)], 1))
    assert [b.block_hash for b in index.worker_blocks(W0, WINDOW)] == [1, 2]
    assert not index.is_degraded(W0)


# ---------------------------------------------------------------- split Stored events


def test_split_stored_event_applies_and_chains_to_the_previous_fragment(index, feed):
    feed(index, batch([created(0), stored(1, [1, 2])], 0))
    # the fragment says parent None: the index chains it to block 2, the last one applied
    feed(index, batch([stored(1, [3, 4], parent=None), stored(2, [5], parent=4)], 1, offset=2))
    assert index.find_matches([1, 2, 3, 4, 5]) == {W0: 5}
    assert index.find_matches_for_tokens(tokens_for([1, 2, 3, 4, 5]), BLOCK) == {W0: 5}
    assert not index.is_degraded(W0)


def test_replayed_fragment_changes_nothing_and_overlap_applies_only_new_blocks(index, feed):
    feed(index, batch([created(0), stored(1, [1, 2])], 0))
    fragment = batch([stored(1, [3, 4], parent=2)], 1, offset=2)
    feed(index, fragment)
    state = index.to_bytes()
    feed(index, fragment)
    assert index.to_bytes() == state
    # a re-split replay overlapping what was applied: only block 5 is new
    feed(index, batch([stored(1, [4, 5], parent=3)], 2, offset=3))
    assert index.find_matches_for_tokens(tokens_for([1, 2, 3, 4, 5]), BLOCK) == {W0: 5}
    assert not index.is_degraded(W0)


def test_lost_fragment_degrades(index, feed):
    feed(index, batch([created(0), stored(1, [1, 2])], 0))
    feed(index, batch([stored(1, [5, 6], parent=4)], 1, offset=4))
    assert index.is_degraded(W0)
    assert "missing blocks of split Stored event 1" in index.worker_stats(W0).degraded_reasons[0]
    assert index.find_matches([5, 6]) == {W0: 2}


def test_fragment_of_an_unseen_event_degrades(index, feed):
    feed(index, batch([created(0)], 0))
    feed(index, batch([stored(1, [3, 4], parent=2)], 1, offset=2))
    assert index.is_degraded(W0)


# ---------------------------------------------------------------- stats and seams


def test_worker_stats_report_cursor_session_levels_and_capacity(index, feed):
    feed(
        index,
        batch([created(0, levels=(100, 20)), stored(1, [1, 2]), updated(2, 1, level=(0, 1))], 3, pid=11),
    )
    stats = index.worker_stats(W0)
    assert (stats.last_event_id, stats.producer_id, stats.last_batch_sequence) == (2, 11, 3)
    assert stats.windows[WINDOW].capacity == (100, 20)
    assert stats.blocks_by_level == {0: 1, 1: 1} and stats.blocks == 2
    with pytest.raises(KeyError, match="unknown worker"):
        index.worker_stats(WorkerKey("nope", 0))


def test_degraded_reasons_are_capped_and_the_rest_counted(index, feed):
    feed(index, batch([created(0)], 0))
    for i in range(12):
        feed(index, batch([stored(2 + 2 * i, [i])], 1 + i))
    reasons = index.worker_stats(W0).degraded_reasons
    assert len(reasons) == 9 and reasons[-1] == "... 4 more"


def test_memory_estimate_grows_with_blocks(index, feed):
    feed(index, batch([created(0)], 0))
    before = index.memory_bytes()
    feed(index, batch([stored(1, list(range(1, 40001)))], 1))
    assert index.memory_bytes() - before >= 40000 * 32


def test_snapshot_replaces_a_worker_and_clears_degraded(index, feed):
    feed(index, batch([created(0), stored(1, [1, 2]), stored(5, [9])], 0))
    assert index.is_degraded(W0)
    index.load_worker_snapshot(
        W0,
        {64: [KVCacheStoredData(None, [block(1), block(3)])], 128: [KVCacheStoredData(None, [block(7)])]},
        last_event_id=10,
        capacities={64: [50, 5]},
    )
    assert not index.is_degraded(W0)
    assert [b.block_hash for b in index.worker_blocks(W0, 64)] == [1, 3]
    assert index.find_matches_for_tokens(tokens_for([1, 3]), BLOCK) == {W0: 2}
    assert index.worker_stats(W0).windows[64].capacity == (50, 5)
    feed(index, batch([stored(10, [4], parent=3), removed(11, [3])], 1))
    assert [b.block_hash for b in index.worker_blocks(W0, 64)] == [1]  # event 10 is a replay, 11 applies
    assert not index.is_degraded(W0)


def test_reset_and_mark_degraded(index, feed):
    feed(index, batch([created(0), stored(1, [1])], 0))
    index.mark_degraded(W0, "reader skipped a malformed message")
    assert index.worker_stats(W0).degraded_reasons == ("reader skipped a malformed message",)
    index.reset_worker(W0)
    assert index.held_blocks() == 0 and index.is_degraded(W0)
    index.reset_worker(W0, clear_degraded=True)
    assert not index.is_degraded(W0)
    feed(index, batch([stored(2, [2])], 1))
    assert index.find_matches([2]) == {W0: 1} and not index.is_degraded(W0)


def test_mark_instance_degraded_flags_the_workers_it_has_and_makes_none(index, feed):
    """What a reader does with a malformed message keyed by an instance: it used to list every
    worker of the index and pick the instance's (0.25 s a message at 262,144 workers)."""
    feed(index, batch([stored(0, [1], rank=0), stored(0, [2], rank=2)], 0, dp=4))
    feed(index, batch([stored(0, [3])], 0, instance="other"))
    assert index.mark_instance_degraded("i0", "a malformed message was skipped") == 2
    assert index.degraded_workers() == [W0, WorkerKey("i0", 2)]
    assert index.worker_stats(W0).degraded_reasons == ("a malformed message was skipped",)
    assert index.mark_instance_degraded("never-seen", "x") == 0
    assert len(index.workers()) == 3 and "never-seen" not in {w.instance_id for w in index.workers()}


# ---------------------------------------------------------------- inputs and cores


def test_queries_accept_arrays_and_lists_alike(index, feed):
    from array import array

    feed(index, batch([created(0), stored(1, [1, 2, 2**64 - 1])], 0))
    assert (
        index.find_matches(array("Q", [1, 2, 2**64 - 1])) == index.find_matches([1, 2, 2**64 - 1]) == {W0: 3}
    )
    tokens = tokens_for([1, 2])
    assert index.content_hashes(array("i", tokens), BLOCK) == index.content_hashes(tokens, BLOCK)


def test_core_choice(monkeypatch):
    assert CacheIndex(core="python").compiled is False
    assert CacheIndex(core="compiled").compiled is True
    monkeypatch.setenv("KVEVENTS_PURE_PYTHON", "0")  # "0" means off, as for the codec and recorder
    assert CacheIndex().compiled is True
    monkeypatch.setenv("KVEVENTS_PURE_PYTHON", "1")
    assert CacheIndex().compiled is False
    with pytest.raises(ValueError, match="core must be"):
        CacheIndex(core="rust")


def test_runs_over_equal_sized_but_different_holder_sets(index, feed):
    # ranks 0 and 1 hold blocks 1-3; ranks 1 and 2 hold 4-6: same count, other set at block 4
    feed(
        index,
        batch(
            [created(0, rank=r) for r in range(3)]
            + [
                stored(1, [1, 2, 3], rank=0),
                stored(1, [1, 2, 3, 4, 5, 6], rank=1),
                stored(1, [4, 5, 6], parent=3, rank=2),
            ],
            0,
            dp=3,
        ),
    )
    assert index.find_matches([1, 2, 3, 4, 5, 6]) == {W0: 3, W1: 6}
    assert index.find_matches([4, 5, 6]) == {W1: 3, WorkerKey("i0", 2): 3}
    feed(index, batch([updated(2, 5, level=(0, 1), rank=1)], 1, dp=3))
    details = index.match_details([1, 2, 3, 4, 5, 6])
    assert details[W1] == (6, 5)
    assert index.find_matches([1, 2, 3, 4, 5, 6], max_cache_level=0) == {W0: 3, W1: 4}


def test_degraded_workers_instances_and_workers_of_agree_with_the_worker_records(index, feed):
    """``degraded_workers`` reads the gap counts in one pass and ``workers_of`` only the given
    instances' workers (route --serve asks both every 0.2 s): the same answers as walking every
    worker's record."""
    for n, name in enumerate(["c", "a", "b"]):
        feed(index, batch([created(0, rank=r) for r in range(3)], 0, instance=name, dp=3))
        if n != 1:  # a's ranks stay clean; c loses events of rank 1, b a whole batch (every rank)
            dropped = [(1, 2)] if name == "c" else []
            feed(
                index,
                batch(
                    [stored(1, [n * 10 + 1])], 1 if name == "c" else 3, instance=name, dp=3, dropped=dropped
                ),
            )
    workers = index.workers()
    assert index.degraded_workers() == [k for k in workers if index.is_degraded(k)]
    assert index.degraded_workers() == [WorkerKey("b", r) for r in range(3)] + [WorkerKey("c", 1)]
    assert index.instances() == ["a", "b", "c"]
    assert index.workers_of(["c", "unknown", "a"]) == [k for k in workers if k.instance_id in ("a", "c")]
    assert index.workers_of([]) == []


def test_stats_counts_workers_and_degraded_workers_without_walking_records(index, feed):
    feed(index, batch([created(0, rank=r) for r in range(4)], 0, dp=4))
    feed(index, batch([], 1, dp=4, dropped=[(2, 5)]))
    stats = index.stats()
    assert (
        (stats.workers, stats.degraded_workers)
        == (4, 1)
        == (len(index.workers()), len(index.degraded_workers()))
    )
