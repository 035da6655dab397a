"""Nothing lost without a count, end to end: every event a simulated rank flushed is on the topic
or reported lost in-band (``EventBatch.dropped``), and a worker with losses is degraded.

Ranks run flat out (``--no-realtime``) for a fixed number of requests; rank 0 gets far fewer
(``mpiexec``'s MPMD form: one command line per group of ranks), so it finishes well before the
others; the buffers are small, so ranks drop events. Under real ``mpiexec`` against the real
broker, the topic is read back and checked per rank: delivered + reported == flushed.
A rank that finished first used to stop the instance's gather for the others (its close makes
rank 0 STOP every rank), whose later events then stayed in their own buffers, never delivered
and never reported: the summary called the run clean and the index saw no loss.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from collections import Counter
from typing import Any

import pytest
from kvevents.consumer import CacheIndex, EventReader
from kvevents.producer import find_mpiexec

RANKS = 3
RANK0_REQUESTS = 30
REQUESTS = 300
BUFFER = 300


def run_simulate(bootstrap: str, topic: str, prefix: str) -> tuple[int, dict[str, Any], str]:
    """``mpiexec -n 1 kvevents simulate --requests 30 ... : -n 2 kvevents simulate --requests 300 ...``"""

    def ranks(n: int, requests: int) -> list[str]:
        return [
            "-n", str(n), sys.executable, "-m", "kvevents.cli", "simulate", "--instance-prefix", prefix,
            "--ranks", str(RANKS), "--requests", str(requests), "--no-realtime",
            "--max-kv-event-entries", str(BUFFER), "-b", bootstrap, "--topic", topic, "--json",
        ]  # fmt: skip

    mpiexec = find_mpiexec()
    if mpiexec is None:
        pytest.fail("mpiexec not found: pip install -e '.[dev]' brings mpich", pytrace=False)
    command = [mpiexec, *ranks(1, RANK0_REQUESTS), ":", *ranks(RANKS - 1, REQUESTS)]
    env = {k: v for k, v in os.environ.items() if k != "KVEVENTS_RANK_GUARD_PID"}
    try:
        proc = subprocess.run(command, capture_output=True, text=True, env=env, timeout=120)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"kvevents simulate hung (killed after 120 s)\n{exc.stderr!r}"[-3000:])
    context = f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    try:
        return proc.returncode, json.loads(proc.stdout), context
    except json.JSONDecodeError:
        pytest.fail(f"no JSON summary: {context}")


def test_every_flushed_event_is_delivered_or_reported_lost_in_band(
    kafka_bootstrap: str, kafka_topic: str
) -> None:
    prefix = f"acct{uuid.uuid4().hex[:6]}"
    code, summary, context = run_simulate(kafka_bootstrap, kafka_topic, prefix)
    flushed = {(r["instance_id"], r["attention_dp_rank"]): r["events_enqueued"] for r in summary["per_rank"]}
    assert len(flushed) == RANKS and not summary["failed_ranks"], context

    delivered: Counter[tuple[str, int | None]] = Counter()
    reported: Counter[tuple[str, int]] = Counter()
    with EventReader(kafka_bootstrap, kafka_topic) as reader:
        for batch in reader.batches(until_caught_up=True):
            for drops in batch.dropped:
                reported[(batch.instance_id, drops.attention_dp_rank)] += drops.dropped_events
            # A Stored event split over messages is one event: count it where it starts.
            events = batch.events[1:] if batch.first_event_block_offset else batch.events
            for event in events:
                delivered[(batch.instance_id, event.attention_dp_rank)] += 1
    figures = {w: (flushed[w], delivered[w], reported[w]) for w in flushed}
    assert all(d + r == f for f, d, r in figures.values()), (
        f"(flushed, delivered, reported): {figures}\n{context}"
    )
    lossy = {w for w in flushed if reported[w]}
    assert lossy, f"the buffers were meant to overflow: {figures}"

    index = CacheIndex()
    with EventReader(kafka_bootstrap, kafka_topic) as reader:
        assert reader.apply_to(index).malformed == 0
    degraded = {(w.instance_id, w.attention_dp_rank) for w in index.degraded_workers()}
    assert degraded == lossy, figures

    assert code == 0, context
    assert summary["events_unaccounted_by_rank"] == {}
    assert summary["events_lost_unreported"] == 0
