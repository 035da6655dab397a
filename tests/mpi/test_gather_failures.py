"""A rank that dies (SIGKILL, or exit without MPI_Finalize) or stalls: rank 0 detects it within
the heartbeat timeout, reports it (counter, log, one in-band dropped event), keeps gathering the
other ranks, and shuts down without waiting for it; nothing hangs, MPI_Finalize included.
Also pins what MPICH's hydra does on its own. Programs: ``programs/peer_failure.py``."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest

MpiRunner = Callable[..., Any]  # the ``mpirun`` fixture of conftest.py

VICTIM = 2
TIMEOUT_S = 1.0  # the programs' heartbeat_timeout_s
INTERVAL_S = 0.1  # their heartbeat_interval_s
SURVIVORS = (0, 1, 3)


def load(run: Any, name: str) -> dict[str, Any]:
    path = run.out / f"{name}.json"
    assert path.exists(), f"{name}.json missing\n{run.describe()}"
    data: dict[str, Any] = json.loads(path.read_text())
    return data


def check_survivors(run: Any) -> dict[str, Any]:
    """What must hold whatever happened to the victim; returns rank 0's result."""
    for rank in SURVIVORS:
        assert rank in run.results, f"rank {rank} wrote no result\n{run.describe()}"
        assert "error" not in run.results[rank], run.describe()
    root = run.results[0]
    stats = root["gather"]
    assert stats["state"] == "stopped"
    assert stats["dead_rank_detections_total"] == 1
    # Every survivor's events, before and after the failure, reached rank 0 once and in order.
    for rank in SURVIVORS:
        assert root["received_ids"][str(rank)] == list(range(run.results[rank]["enqueued"])), rank
    for rank in (1, 3):
        assert run.results[rank]["gather"]["stop_reason"] == "rank 0 stopped the gather"
    # In-band: the victim is reported with exactly one dropped event (its unsent events are
    # unknowable; one marks its view incomplete).
    assert sum(n for _, n in root["victim_drops"]) == 1
    # The shutdown did not wait for the dead rank.
    assert root["close_s"] < 2.0, root["close_s"]
    return root


def check_detection(run: Any, root: dict[str, Any], failed_at: float) -> None:
    detected_at = root["victim_drops"][0][0]
    delay = detected_at - failed_at
    # Rank 0 last heard from the victim at most a heartbeat interval (or a period) before it
    # failed, and checks every few ms; the reader adds up to 50 ms.
    assert TIMEOUT_S - INTERVAL_S - 0.05 <= delay <= TIMEOUT_S + 0.5, (
        f"detected {delay:.3f}s after the failure"
    )


def check_victim_prefix(root: dict[str, Any], victim: dict[str, Any]) -> None:
    """What the victim sent before it died was delivered once, in order: a prefix of its ids,
    at least all it had sent when it last looked, at most all it had enqueued."""
    received = root["received_ids"][str(VICTIM)]
    assert received == list(range(len(received)))
    assert victim["sent_events"] <= len(received) <= victim["enqueued_total"]


def test_sigkilled_rank_is_detected_reported_and_the_others_go_on(mpirun: MpiRunner) -> None:
    run = mpirun(
        "peer_failure.py", 4, "--how", "sigkill", "--victim", str(VICTIM), timeout=60,
        mpiexec_args=["-disable-auto-cleanup"],
    )  # fmt: skip
    assert load(run, "victim_fate") == {"signaled": True, "signal": 9}
    victim = load(run, "victim")
    root = check_survivors(run)
    check_detection(run, root, victim["died_at"])
    assert root["gather"]["ranks_dead"] == [VICTIM]
    check_victim_prefix(root, victim)
    assert run.returncode == 0, run.describe()  # the victim's parent exits 0; all others finalize


def test_rank_exiting_without_finalize_is_handled_and_survivors_finalize(mpirun: MpiRunner) -> None:
    run = mpirun(
        "peer_failure.py", 4, "--how", "exit", "--victim", str(VICTIM), timeout=60,
        mpiexec_args=["-disable-auto-cleanup"],
    )  # fmt: skip
    victim = load(run, "victim")
    root = check_survivors(run)
    check_detection(run, root, victim["died_at"])
    check_victim_prefix(root, victim)
    # The job ends (no MPI_Finalize hang) with the victim's exit status.
    assert run.returncode == 1, run.describe()


def test_stalled_rank_does_not_stall_the_others_and_is_taken_back(mpirun: MpiRunner) -> None:
    stall_s = 1.6
    run = mpirun(
        "peer_failure.py", 4, "--how", "stall", "--victim", str(VICTIM), "--stall-s", str(stall_s), timeout=60,
        mpiexec_args=["-disable-auto-cleanup"],
    )  # fmt: skip
    run.assert_clean(4)
    victim = load(run, "victim")
    root = check_survivors(run)
    check_detection(run, root, victim["stopped_at"])
    stats = root["gather"]
    assert stats["ranks_dead"] == []  # taken back once it spoke again
    assert sorted(stats["ranks_left"]) == [1, 2, 3]
    # Nothing of the stalled rank is lost: all its events, once, in order.
    assert root["received_ids"][str(VICTIM)] == list(range(run.results[VICTIM]["enqueued"]))
    # While it was stopped, the other ranks' events kept arriving.
    start, end = victim["stopped_at"] + 0.1, victim["stopped_at"] + stall_s - 0.1
    during = [t for t in root["arrival_times_of_others"] if start <= t <= end]
    assert len(during) > 10
    gaps = [b - a for a, b in zip([start, *during], [*during, end], strict=True)]
    assert max(gaps) < 0.3, max(gaps)


def test_hydra_by_default_kills_the_whole_job_when_a_rank_dies(mpirun: MpiRunner) -> None:
    # Documented MPICH behaviour the gather cannot change: without -disable-auto-cleanup a
    # SIGKILLed rank makes hydra SIGKILL every other rank at once; nothing hangs either.
    run = mpirun(
        "peer_failure.py", 4, "--how", "sigkill", "--hydra-sees-death", "--victim", str(VICTIM), timeout=60
    )
    assert run.returncode == 9, run.describe()
    assert run.seconds < 15
    assert load(run, "victim")["enqueued_total"] > 0  # the victim got as far as dying
    assert run.results == {}  # no rank lived to write its result


@pytest.mark.parametrize("how", ["sigkill", "exit"])
def test_rank_0_closes_promptly_even_before_it_noticed_the_death(mpirun: MpiRunner, how: str) -> None:
    # A longer heartbeat timeout than the survivors' phase 2: rank 0 closes while the victim
    # still counts as alive, so the shutdown itself must end at the timeout, not hang.
    run = mpirun(
        "peer_failure.py", 4, "--how", how, "--victim", str(VICTIM), "--heartbeat-timeout-s", "3.0",
        "--phase2-s", "0.5", timeout=60, mpiexec_args=["-disable-auto-cleanup"],
    )  # fmt: skip
    victim = load(run, "victim")
    root = run.results[0]
    assert root["gather"]["state"] == "stopped"
    assert root["gather"]["ranks_dead"] == [VICTIM]
    check_victim_prefix(root, victim)
    for rank in SURVIVORS:
        assert root["received_ids"][str(rank)] == list(range(run.results[rank]["enqueued"])), rank
    # Rank 0 started closing before the timeout ran out; it waited for the rest of it, no more.
    assert root["close_s"] < 3.0 + 0.5
