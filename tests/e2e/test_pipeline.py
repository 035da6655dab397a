"""The pipeline end to end: ``kvevents simulate`` under ``mpiexec -n 4`` -> real Kafka -> an
index rebuilt by the EventReader equals the simulators' ground truth; with a tiny event
buffer the workers that lost events are flagged degraded until their snapshots rebuild them;
``kvevents demo`` runs the whole thing and exits 0."""

from __future__ import annotations

import json
import subprocess

from kvevents.consumer import CacheIndex, EventReader, WorkerKey

from kvevents.verify import compare, load_ground_truth

WORKERS = [WorkerKey("sim-0", r) for r in range(4)]


def test_simulate_under_mpiexec_through_kafka_rebuilds_the_ground_truth(
    kvevents_cli, kafka_bootstrap, kafka_topic_factory, tmp_path
):
    topic = kafka_topic_factory(partitions=2)
    truth = tmp_path / "truth.jsonl"
    run = kvevents_cli(
        "simulate",
        "--duration",
        "4",
        "--rate",
        "20",
        "-b",
        kafka_bootstrap,
        "--topic",
        topic,
        "--ground-truth",
        str(truth),
        "--json",
        ranks=4,
    )
    assert run.returncode == 0, run.describe()
    summary = run.json()
    assert summary["ranks"] == 4 and not summary["failed_ranks"] and summary["drops"] == 0
    assert summary["events"] > 200 and summary["events_delivered"] == summary["events"]
    assert all(r["events_enqueued"] > 0 for r in summary["per_rank"])

    index = CacheIndex()
    with EventReader(kafka_bootstrap, topic) as reader:
        read = reader.apply_to(index)
    assert read.events == summary["events"] and read.malformed == 0
    truths = load_ground_truth(truth)
    assert sorted((t.instance_id, t.attention_dp_rank) for t in truths) == [tuple(w) for w in WORKERS]
    report = compare(index, truths)
    assert report.ok, report.describe()
    assert index.workers() == WORKERS and sum(w.blocks for w in report.workers) > 100


def test_forced_drops_degrade_workers_until_their_snapshots_rebuild_them(
    kvevents_cli, kafka_bootstrap, kafka_topic, tmp_path
):
    truth = tmp_path / "truth.jsonl"
    run = kvevents_cli(
        # Flat out (no real-time pacing) into a 100-event buffer: every rank's buffer and rank 0's
        # (4 x 100, holding the other ranks' events too) overflow again and again.
        "simulate",
        "--no-realtime",
        "--requests",
        "150",
        "--max-kv-event-entries",
        "100",
        "--num-primary-blocks",
        "256",
        "--num-secondary-blocks",
        "64",
        "--snapshot-on-drops",
        "-b",
        kafka_bootstrap,
        "--topic",
        kafka_topic,
        "--ground-truth",
        str(truth),
        "--json",
        ranks=4,
    )
    assert run.returncode == 0, run.describe()
    summary = run.json()
    assert summary["drops"] > 0 and summary["snapshots"] > 0, (
        f"the tiny buffer dropped nothing:\n{run.describe()}"
    )
    assert all(r["snapshots"] > 0 for r in summary["per_rank"]), (
        "every rank lost events, every rank must resync"
    )
    assert summary["events_lost_unreported"] == 0
    snapshotted = {
        WorkerKey(r["instance_id"], r["attention_dp_rank"]) for r in summary["per_rank"] if r["snapshots"]
    }

    index = CacheIndex()
    ever_degraded: set[WorkerKey] = set()
    with EventReader(kafka_bootstrap, kafka_topic) as reader:
        for batch in reader.batches(until_caught_up=True):
            index.apply(batch)
            ever_degraded.update(index.degraded_workers())
    assert ever_degraded, "drops were made but no worker was ever flagged degraded"
    assert ever_degraded <= snapshotted, (
        f"degraded {ever_degraded}, but only {snapshotted} published snapshots"
    )
    assert index.stats().counters["resyncs"] >= len(ever_degraded)
    report = compare(index, load_ground_truth(truth))
    assert report.ok, report.describe()
    assert not index.degraded_workers()


def test_demo_runs_the_whole_pipeline_and_exits_0(kvevents_cli, kafka_bootstrap):
    run = kvevents_cli(
        "demo",
        "--duration",
        "5",
        "--rate",
        "20",
        "--held-out",
        "200",
        "-b",
        kafka_bootstrap,
        "--json",
        timeout=150,
    )
    assert run.returncode == 0, run.describe()
    report = json.loads(run.stdout)
    assert report["ok"] and report["broker_started"] is False and report["instances"] == 2
    assert report["verify"]["equal_workers"] == 8
    assert report["rebuild"]["events"] == sum(s["events"] for s in report["simulate"]) > 0
    rates = report["routing"]["hit_rate"]
    assert rates["index"] > rates["round_robin"] and rates["index"] > rates["random"]


def test_demo_without_a_configured_broker_starts_one_and_leaves_nothing_running(
    kvevents_cli, kafka, tmp_path
):
    from kvevents.broker import LocalBroker

    state = tmp_path / "demo-broker"
    env = {"KVEVENTS_BROKER_DIR": str(state), "KAFKA_BOOTSTRAP_SERVERS": ""}
    run = kvevents_cli(
        "demo", "--duration", "3", "--instances", "1", "--held-out", "50", "--json", env=env, timeout=180
    )
    assert run.returncode == 0, run.describe()
    report = json.loads(run.stdout)
    assert report["ok"] and report["broker_started"] is True
    assert not LocalBroker(state).status().running
    leftovers = subprocess.run(["pgrep", "-f", str(state)], capture_output=True, text=True)
    assert leftovers.stdout == "", f"processes left running: {leftovers.stdout}"
