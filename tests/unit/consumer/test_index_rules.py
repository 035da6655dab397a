"""Every rule of CacheIndex but the content rules (test_index_content_rules.py), on both cores,
fed model objects and real Avro bytes."""

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
from kvevents.consumer._pycore_model import MAX_RETIRED_PRODUCERS
from kvevents.consumer._state import MAX_REASONS, decode_state
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


# ---------------------------------------------------------------- gaps


def test_event_id_jump_degrades_until_created(index, feed):
    feed(index, batch([created(0), stored(1, [1])], 0))
    feed(index, batch([stored(5, [2], parent=1)], 1))
    stats = index.worker_stats(W0)
    assert stats.degraded and stats.degraded_reasons == ("event ids jumped from 1 to 5",)
    assert index.find_matches([1, 2]) == {W0: 2}  # still applied: the best known view
    assert index.degraded_workers() == [W0]
    feed(index, batch([created(6)], 2))
    assert not index.is_degraded(W0) and index.held_blocks() == 0


def test_sequence_jump_degrades_every_rank_of_the_instance(index, feed):
    """Every rank below attention_dp_size: the workers there are, and a rank not seen yet when
    its first event comes (no worker is made for it before: a batch of a few bytes naming 1,024
    ranks made 1,024 workers)."""
    feed(index, batch([created(0, rank=0)], 0, dp=2))
    feed(index, batch([stored(1, [1], rank=0)], 3, dp=2))
    lost = ("batches lost: producer 7 sequence jumped from 0 to 3",)
    assert index.degraded_workers() == [W0] and index.worker_stats(W0).degraded_reasons == lost
    assert index.worker_stats(W0).last_batch_sequence == 3
    assert W1 not in index.workers(), "rank 1 has sent nothing yet"
    feed(index, batch([stored(0, [5], rank=1)], 4, dp=2))
    assert index.degraded_workers() == [W0, W1]
    assert index.worker_stats(W1).degraded_reasons == lost


def test_degrading_every_rank_makes_no_worker_for_a_rank_never_seen(index, feed):
    wide = 1024
    feed(index, batch([created(0, rank=0)], 0, dp=wide))
    for seq in (3, 6, 9):  # a jump each time
        feed(index, batch([], seq, dp=wide))
    assert index.workers() == [W0] and len(index.worker_stats(W0).degraded_reasons) == 3
    feed(index, batch([stored(0, [5], rank=1000)], 10, dp=wide))
    late = WorkerKey("i0", 1000)
    assert len(index.worker_stats(late).degraded_reasons) == 3
    feed(index, batch([stored(0, [6], rank=1023)], 11, dp=1024))
    assert index.is_degraded(WorkerKey("i0", 1023))
    assert set(index.workers()) == {W0, late, WorkerKey("i0", 1023)}


def test_a_producer_whose_other_ranks_never_come_keeps_few_pending_degradations(index, feed):
    """Each gap of an instance whose other ranks never send used to add one degradation for
    them, kept in memory and in every checkpoint without bound (2,000 gaps: 2,000 entries). At
    most MAX_REASONS are kept, as a worker keeps its reasons; past that a gap covering more
    ranks than any kept replaces the last, so every rank a gap covered is degraded when it comes."""
    feed(index, batch([created(0, rank=0)], 0, dp=4))
    for k in range(1, 2001):  # a jump each time
        feed(index, batch([], 2 * k, dp=4))
    feed(index, batch([], 5000, dp=64))  # wider: ranks 4..63 too
    feed(index, batch([], 5002, dp=4))
    (state,) = index._core.export_state().instances  # type: ignore[attr-defined]
    assert len(state.pending_degraded) == MAX_REASONS
    assert [below for _, below in state.pending_degraded] == [4] * (MAX_REASONS - 1) + [64]
    assert index.worker_stats(W0).degraded_reasons[MAX_REASONS:] == ("... 1994 more",)  # 2,002 gaps
    feed(index, batch([stored(0, [5], rank=3), stored(0, [6], rank=40)], 5003, dp=64))
    assert index.is_degraded(WorkerKey("i0", 3)) and index.is_degraded(WorkerKey("i0", 40))
    assert len(index.worker_stats(WorkerKey("i0", 3)).degraded_reasons) == MAX_REASONS
    assert index.worker_stats(WorkerKey("i0", 40)).degraded_reasons == (
        "batches lost: producer 7 sequence jumped from 4000 to 5000",
    )
    again = CacheIndex.from_bytes(index.to_bytes(), core="compiled" if index.compiled else "python")
    assert again.same_state(index)


def test_in_band_drops_degrade_their_rank_only(index, feed):
    feed(index, batch([created(0, rank=0), created(0, rank=1)], 0, dp=2))
    feed(index, batch([stored(1, [1], rank=0)], 1, dp=2, dropped=[(1, 3), (0, 0)]))
    assert index.degraded_workers() == [W1]
    assert index.worker_stats(W1).degraded_reasons == ("3 events dropped before batch 1",)


def test_drops_in_a_replayed_batch_are_not_counted_again(index, feed):
    lossy = batch([stored(5, [1])], 1, dropped=[(0, 4)])
    feed(index, batch([created(0)], 0))
    feed(index, lossy)
    feed(index, batch([created(6)], 2))  # rebuilt
    feed(index, lossy)  # replayed (e.g. a reader resuming from an older offset)
    assert not index.is_degraded(W0)


def test_drop_before_a_created_in_the_same_batch_is_healed(index, feed):
    feed(index, batch([created(0), stored(1, [1])], 0))
    feed(index, batch([created(9)], 1, dropped=[(0, 7)]))
    assert not index.is_degraded(W0)


def test_joining_mid_stream_degrades_unless_first_event_is_created_or_id_zero(index, feed):
    feed(index, batch([stored(40, [1], rank=0), created(40, rank=1)], 5, dp=3))
    feed(index, batch([stored(0, [2], rank=2)], 6, dp=3))
    assert index.degraded_workers() == [W0]
    assert "joined mid-stream" in index.worker_stats(W0).degraded_reasons[0]


# ---------------------------------------------------------------- producer sessions


def test_new_producer_restarting_event_ids_with_created_is_clean(index, feed):
    feed(index, batch([created(0), stored(1, [1]), stored(2, [2], parent=1)], 0, pid=1))
    feed(index, batch([created(0), stored(1, [3])], 0, pid=2))
    assert not index.is_degraded(W0)
    assert index.find_matches([3]) == {W0: 1} and index.find_matches([1]) == {}
    stats = index.worker_stats(W0)
    assert (stats.producer_id, stats.last_batch_sequence, stats.last_event_id) == (2, 0, 1)


def test_new_producer_continuing_event_ids_is_clean(index, feed):
    feed(index, batch([created(0), stored(1, [1])], 0, pid=1))
    feed(index, batch([stored(2, [2], parent=1)], 0, pid=2))
    assert not index.is_degraded(W0)
    assert index.find_matches([1, 2]) == {W0: 2}


def test_new_producer_without_created_or_continuity_degrades(index, feed):
    feed(index, batch([created(0), stored(1, [1]), stored(2, [2], parent=1)], 0, pid=1))
    feed(index, batch([stored(0, [3])], 0, pid=2))
    assert index.is_degraded(W0)
    assert index.worker_stats(W0).degraded_reasons == (
        "new producer session 2: first event id 0 neither follows 2 nor is a Created event",
    )
    assert index.find_matches([3]) == {W0: 1}  # applied, not mistaken for a duplicate


def test_new_producer_not_starting_at_sequence_zero_degrades(index, feed):
    feed(index, batch([created(0)], 0, pid=1))
    feed(index, batch([stored(1, [1])], 4, pid=2))
    assert index.worker_stats(W0).degraded_reasons == ("new producer session 2 started at sequence 4, not 0",)


def test_old_batches_of_a_retired_producer_are_stale(index, feed):
    feed(index, batch([created(0), stored(1, [1])], 0, pid=1))
    feed(index, batch([stored(2, [3])], 1, pid=1))
    feed(index, batch([created(0)], 0, pid=2))
    feed(index, batch([stored(2, [5])], 1, pid=1))  # redelivered: producer 1 had sent batch 1
    assert index.find_matches([5]) == {}
    assert index.stats().counters["batches_stale"] == 1
    assert index.stats().counters["session_conflicts"] == 0
    assert index.degraded_workers() == []


def test_new_batches_of_a_retired_producer_are_a_session_conflict(index, feed, caplog):
    feed(index, batch([created(0, rank=0), created(0, rank=1), stored(1, [1], rank=0)], 0, pid=1, dp=2))
    feed(index, batch([created(0, rank=0), created(0, rank=1)], 0, pid=2, dp=2))
    with caplog.at_level("WARNING", logger="kvevents.consumer.index"):
        feed(index, batch([stored(2, [5], rank=0)], 1, pid=1, dp=2))  # producer 1 is still alive
    assert index.find_matches([5]) == {}
    counters = index.stats().counters
    assert (counters["session_conflicts"], counters["batches_stale"]) == (1, 0)
    assert sorted(index.degraded_workers()) == [WorkerKey("i0", 0), WorkerKey("i0", 1)]
    reasons = index.worker_stats(WorkerKey("i0", 1)).degraded_reasons
    assert reasons == (
        "session conflict: producer 1, retired when producer 2 started, sent new batch 1: "
        "two live producers share this instance_id (its batches are ignored)",
    )
    assert "session conflict" in caplog.text
    feed(index, batch([stored(2, [5], rank=0)], 1, pid=1, dp=2))  # the same batch again: stale
    feed(index, batch([stored(3, [6], rank=0)], 2, pid=1, dp=2))  # and its next: a conflict again
    counters = index.stats().counters
    assert (counters["session_conflicts"], counters["batches_stale"]) == (2, 1)
    state = index.to_bytes()
    restored = CacheIndex.from_bytes(state, core="python")
    restored.apply(batch([stored(4, [7], rank=0)], 3, pid=1, dp=2))
    assert restored.stats().counters["session_conflicts"] == 1  # the last sequence survived


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


def test_an_instance_remembers_its_last_retired_producers_not_all(index, feed):
    """Each new producer id retires the previous one; an instance keeps the last
    MAX_RETIRED_PRODUCERS of them (a stream of ever-new ids no longer grows every checkpoint).
    A checkpoint keeps retirement order, so a restored index forgets the same ids as a replay."""
    total = MAX_RETIRED_PRODUCERS + 40
    core = "compiled" if index.compiled else "python"
    replayed = CacheIndex(core=core)
    halfway = None
    for pid in range(1, total + 2):
        b = batch([created(0)], 0, pid=pid)
        feed(index, b)
        replayed.apply(b)
        if pid == total // 2:
            halfway = index.to_bytes()
    state = decode_state(index.to_bytes()).instances[0]
    assert len(state.retired) == MAX_RETIRED_PRODUCERS
    assert state.retired == list(range(total + 1 - MAX_RETIRED_PRODUCERS, total + 1))  # retirement order
    assert halfway is not None
    restored = CacheIndex.from_bytes(halfway, core=core)
    for pid in range(total // 2 + 1, total + 2):
        restored.apply(batch([created(0)], 0, pid=pid))
    assert restored.same_state(index) and replayed.same_state(index)
    feed(index, batch([stored(1, [7])], 1, pid=total))  # remembered: a session conflict
    assert index.stats().counters["session_conflicts"] == 1
    feed(index, batch([created(0), stored(1, [9])], 0, pid=1))  # forgotten: a new session again
    assert index.find_matches([9]) == {W0: 1}
    assert decode_state(index.to_bytes()).instances[0].retired[-1] == total + 1


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
