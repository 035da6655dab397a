"""CacheIndex's rules for loss and producer sessions, on both cores, fed model objects and real
Avro bytes: event id and sequence gaps, in-band drops, pending degradations of ranks not seen
yet, new producers, retired producers (stale batches, session conflicts, the cap on how many
an instance remembers). The other rules: test_index_rules.py."""

from __future__ import annotations

from _index_helpers import W0, W1, batch, created, stored
from kvevents.consumer import CacheIndex, WorkerKey
from kvevents.consumer._pycore_model import MAX_RETIRED_PRODUCERS
from kvevents.consumer._state import MAX_REASONS, decode_state

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
