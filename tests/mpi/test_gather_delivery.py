"""The attention-DP gather under real ``mpiexec``: every event of every rank reaches rank 0
exactly once, in per-rank order, with its content; drops are exact under overload; rank 0's close stops
every rank cleanly and loses nothing flushed before it, another rank's close stops only that
rank. Programs: ``programs/gather_all.py``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

MpiRunner = Callable[..., Any]  # the ``mpirun`` fixture of conftest.py


@pytest.mark.parametrize(
    ("n", "closer", "pure_python"), [(2, 0, False), (2, 1, False), (4, 0, False), (4, 2, False), (4, 0, True)]
)
def test_every_event_reaches_rank_0_exactly_once_in_order(
    mpirun: MpiRunner, monkeypatch: pytest.MonkeyPatch, n: int, closer: int, pure_python: bool
) -> None:
    # pure_python: every rank on the fallbacks (the manager's PyRecorder, fastavro), as without
    # the compiled extensions (KVEVENTS_PURE_PYTHON reaches the ranks through mpiexec's env).
    if pure_python:
        monkeypatch.setenv("KVEVENTS_PURE_PYTHON", "1")
    run = mpirun(
        "gather_all.py",
        n,
        "--iterations",
        "150",
        "--events",
        "20",
        "--closer",
        str(closer),
        "--after-stop",
        "3",
    )
    run.assert_clean(n)
    root = run.results[0]
    for rank in range(n):
        result = run.results[rank]
        # Everything flushed before rank 0 stopped, once, in event_id order, with its content
        # (when another rank closed first, the others' later events too).
        delivered = result["enqueued"] if closer != 0 else result["enqueued_before_stop"]
        assert root["received_ids"][str(rank)] == list(range(delivered)), rank
        assert result["enqueued_before_stop"] == 150 * 20
    assert root["content_mismatches"] == {}
    assert root["dropped_by_rank"] == {}
    # The engine's own COMM_WORLD traffic (same tag numbers) was never mixed with the gather's.
    assert root["engine_messages_received"] == (n - 1) * 150


@pytest.mark.parametrize(("n", "closer"), [(2, 1), (4, 0), (4, 3)])
def test_rank_0_closing_stops_every_rank_and_another_rank_closing_stops_only_itself(
    mpirun: MpiRunner, n: int, closer: int
) -> None:
    run = mpirun(
        "gather_all.py",
        n,
        "--iterations",
        "40",
        "--events",
        "10",
        "--closer",
        str(closer),
        "--after-stop",
        "5",
    )
    run.assert_clean(n)
    root_stats: dict[str, Any] = run.results[0]["gather"]
    assert root_stats["state"] == "stopped"
    assert root_stats["stop_reason"] == "closed on this rank"
    assert sorted(root_stats["ranks_left"]) == list(range(1, n))
    assert root_stats["ranks_dead"] == []
    for rank in range(1, n):
        stats = run.results[rank]["gather"]
        assert stats["state"] == "stopped", rank
        expected = "rank 0 stopped the gather" if closer == 0 else "closed on this rank"
        assert stats["stop_reason"] == expected, rank
        assert stats["in_flight_messages"] == 0
        after = 0 if rank == closer else 5 * 10
        assert run.results[rank]["enqueued"] == 40 * 10 + after
        if closer == 0:
            # Rank 0 (and its Kafka sink) is gone: later events stay in the rank's own buffer.
            assert run.results[rank]["leftover_local_events"] == after
            assert run.results[0]["received_ids"][str(rank)] == list(range(40 * 10))
        else:
            # Another rank closing stranded nothing: every event of an open rank still went.
            assert run.results[rank]["leftover_local_events"] == 0
            assert run.results[0]["received_ids"][str(rank)] == list(range(40 * 10 + after))


def test_drop_counts_are_exact_per_rank_under_overload(mpirun: MpiRunner) -> None:
    # 40 events per iteration into buffers of 50 (rank 0: 200), a reader that sleeps 20 ms
    # between drains: every rank loses events on its own buffer and on rank 0's.
    run = mpirun(
        "gather_all.py", 4, "--iterations", "300", "--events", "40", "--max-entries", "50",
        "--slow-reader-ms", "20", "--pause-every", "5",
    )  # fmt: skip
    run.assert_clean(4)
    root = run.results[0]
    assert root["content_mismatches"] == {}
    for rank in range(4):
        received = root["received_ids"].get(str(rank), [])
        dropped = root["dropped_by_rank"].get(str(rank), 0)
        enqueued = run.results[rank]["enqueued"]
        assert received == sorted(set(received)), rank  # once each, in order
        assert dropped > 0, rank  # the overload really happened
        assert len(received) + dropped == enqueued, (rank, len(received), dropped, enqueued)
        assert root["buffer"]["events_dropped_by_rank"][str(rank)] == dropped
        if rank:
            # A rank's own buffer overflowed too, and those drops were reported to rank 0.
            assert run.results[rank]["buffer"]["events_dropped_total"] > 0
            assert (
                run.results[rank]["gather"]["events_sent_total"]
                + run.results[rank]["buffer"]["events_dropped_total"]
                == enqueued
            )


def test_a_misconfigured_communicator_fails_alike_on_every_rank(mpirun: MpiRunner) -> None:
    run = mpirun("misconfigured.py", 3, timeout=60)
    run.assert_clean(3)
    messages = [run.results[r]["errors"] for r in range(3)]
    assert all(m == messages[0] for m in messages)  # the same error everywhere, nobody hung
    assert (
        "attention_dp_size must equal the number of processes of the communicator (3)"
        in messages[0]["size_too_big"]
    )
    assert "must be claimed exactly once; claimed [0, 1, 1]" in messages[0]["rank_claimed_twice"]


def test_ranks_exiting_without_close_still_deliver_and_nothing_hangs_at_exit(mpirun: MpiRunner) -> None:
    run = mpirun("exit_without_close.py", 3, timeout=60)
    run.assert_clean(3)
    root = run.results[0]
    assert root["all_left"] is True
    assert root["running_after_they_left"] is True  # only rank 0's own close stops it
    for rank in range(3):
        assert root["received_ids"][str(rank)] == list(range(run.results[rank]["enqueued"])), rank
    assert root["gather"]["stop_reason"] == "closed on this rank"
    assert run.seconds < 30


def test_a_stalled_rank_0_backs_sends_up_to_the_bound_and_drops_are_exact(mpirun: MpiRunner) -> None:
    # Rank 0 stopped for 1.5 s (longer than the 1 s heartbeat timeout) while 3 ranks produce
    # ~50k events/s each into buffers of 2000 with max_in_flight=2.
    run = mpirun("stalled_root.py", 4, timeout=120)
    run.assert_clean(4)
    root = run.results[0]
    assert root["gather"]["dead_rank_detections_total"] == 0  # queued messages are read first
    # rank 0's own buffer (2000 entries) may drop gathered events too, when its reader falls
    # behind on a busy machine: counted per source rank there, beside what each rank reported
    root_drops = root["buffer"]["events_dropped_by_rank"]
    for rank in range(1, 4):
        stats = run.results[rank]["gather"]
        assert stats["sends_deferred_total"] > 0, rank  # the in-flight bound held events back
        received = root["received_ids"][str(rank)]
        dropped = root["dropped_by_rank"][str(rank)]
        own = run.results[rank]["buffer"]["events_dropped_total"]
        assert received == sorted(set(received)), rank
        assert len(received) + dropped == run.results[rank]["enqueued"], (rank, len(received), dropped, own)
        assert dropped == root_drops[str(rank)] and dropped >= own > 0, (rank, dropped, own, root_drops)


def test_losses_at_rank_0_ask_the_losing_rank_for_a_snapshot(mpirun: MpiRunner) -> None:
    run = mpirun("resync.py", 3, timeout=90)
    run.assert_clean(3)
    root, one, two = run.results[0], run.results[1], run.results[2]
    assert one["own_buffer_drops"] == 0  # so only rank 0 could have told it
    assert root["phase1_received"] is True
    assert root["phase1_drops"] == {"1": 150}  # 300 sent, 150 held
    assert one["phase1_requested"] is True, run.describe()
    assert "lost on attention-DP rank 0" in one["phase1_reason"]
    assert one["after_snapshot_requested"] is False
    assert one["phase2_requested"] is False  # event 5 predates its snapshot
    assert two["phase2_requested"] is True
    assert "lost on attention-DP rank 0" in two["phase2_reason"]
    assert one["resyncs_received"] >= 2 and root["resyncs_sent"] >= 3
    assert one["metric_resyncs_received"] >= one["resyncs_received"] > 0  # ProducerMetrics reads the gather
    assert root["metric_resyncs_sent"] >= root["resyncs_sent"] > 0
