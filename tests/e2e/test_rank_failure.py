"""A SIGKILLed rank under real ``mpiexec -disable-auto-cleanup``: ``kvevents simulate`` goes on.

Rank 2's process (behind its guard) is killed mid-run. Rank 0 declares it dead after
``--rank-timeout``, keeps producing the other ranks' events to the end, reports the dead rank's
loss in-band, and the summary names the rank as lost. Rebuilt from Kafka, the index flags only
the dead rank's worker as degraded and equals the survivors' ground truth.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from kvevents.consumer import CacheIndex, EventReader, WorkerKey
from kvevents.producer import find_mpiexec
from kvevents.producer.rank_guard import guarded_rank_pids

from kvevents.verify import compare, load_ground_truth

VICTIM = 2
DURATION_S = 8.0
KILL_AT_S = 3.0


def run_and_kill(bootstrap: str, topic: str, truth: Path, prefix: str) -> tuple[int, dict, str, float]:
    mpiexec = find_mpiexec()
    if mpiexec is None:
        pytest.fail("mpiexec not found: pip install -e '.[dev]' brings mpich", pytrace=False)
    command = [
        mpiexec, "-disable-auto-cleanup", "-n", "4",
        sys.executable, "-m", "kvevents.cli", "simulate", "--instance-prefix", prefix,
        "--duration", str(DURATION_S), "--rate", "20", "--rank-timeout", "1",
        "-b", bootstrap, "--topic", topic, "--ground-truth", str(truth), "--json",
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "KVEVENTS_RANK_GUARD_PID"}
    started = time.monotonic()
    proc = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True
    )
    try:
        victim = None
        while victim is None and time.monotonic() - started < 30:
            victim = guarded_rank_pids(f"--instance-prefix\0{prefix}\0").get(VICTIM)
            time.sleep(0.05)
        assert victim is not None, "rank 2's process never showed up"
        time.sleep(max(0.0, started + KILL_AT_S - time.monotonic()))
        os.kill(victim, signal.SIGKILL)
        killed_at = time.monotonic() - started
        stdout, stderr = proc.communicate(timeout=90)
    except BaseException:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise
    try:
        summary = json.loads(stdout)
    except json.JSONDecodeError:
        pytest.fail(f"no JSON summary (exit {proc.returncode})\n{stdout[-3000:]}\n{stderr[-3000:]}")
    return proc.returncode, summary, stderr, killed_at


def test_a_sigkilled_rank_leaves_the_others_producing_and_its_worker_degraded(
    kafka_bootstrap: str, kafka_topic: str, tmp_path: Path
) -> None:
    prefix = f"rk{uuid.uuid4().hex[:6]}"
    truth = tmp_path / "truth.jsonl"
    code, summary, stderr, killed_at = run_and_kill(kafka_bootstrap, kafka_topic, truth, prefix)
    context = f"exit {code}\n{stderr[-3000:]}"
    # mpiexec reports the victim's guard (128 + SIGKILL); the job itself ran to its end.
    assert code == 128 + signal.SIGKILL, context
    assert f"rank {VICTIM}" in stderr and "killed by SIGKILL" in stderr, context
    assert "declared dead" in stderr, context
    assert summary["failed_ranks"] == [
        f"{prefix}-0/{VICTIM}: rank lost: declared dead by its instance's attention-DP gather"
    ]
    assert summary["seconds"] >= DURATION_S > killed_at + 2
    assert summary["events_lost_unreported"] == 0
    per_rank = {r["attention_dp_rank"]: r for r in summary["per_rank"]}
    kafka = per_rank[0]["kafka"]
    assert per_rank[0]["dead_ranks"] == [VICTIM]
    # Every survivor's event, before and after the death, was delivered; the victim's loss is
    # counted (one event: how many it had not sent is unknowable).
    for rank in (0, 1, 3):
        assert kafka["events_delivered_by_rank"][str(rank)] == per_rank[rank]["events_enqueued"] > 100, rank
    assert kafka["manager_drops_by_rank"] == {str(VICTIM): 1}
    assert kafka["drops_reported_by_rank"] == {str(VICTIM): 1}

    index = CacheIndex()
    with EventReader(kafka_bootstrap, kafka_topic) as reader:
        read = reader.apply_to(index)
    assert read.malformed == 0
    assert index.degraded_workers() == [WorkerKey(f"{prefix}-0", VICTIM)]
    truths = load_ground_truth(truth)  # the survivors' caches at the end of the run
    assert sorted(t.attention_dp_rank for t in truths) == [0, 1, 3]
    report = compare(index, truths)
    assert all(w.equal and not w.degraded for w in report.workers), report.describe()
    assert report.unexpected == [(f"{prefix}-0", VICTIM)]  # in the index, no truth: it died
