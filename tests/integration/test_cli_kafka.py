"""Each consumer-side CLI command once against the real broker: a simulated stream (two
instances of two attention-DP ranks, real managers) and one malformed message in a topic;
``tail`` (also following live, and Ctrl-C), ``index`` (rebuild, --verify, checkpoint file and
topic, --tail), ``route`` (token file, synthetic requests, --serve over HTTP while following),
``stats`` (JSON and --plot)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from cli_streams import BLOCK_SIZE, Produced, simulate_to_topic
from kafka_streams import produce
from kvevents.consumer.topics import TopicSpec, create_topic
from kvevents.producer.simulator import GroundTruth
from kvevents.schemas import (
    EventBatch,
    KVCacheCreatedData,
    KVCacheEvent,
    KVCacheStoredBlockData,
    KVCacheStoredData,
)

from kvevents.cli import main
from kvevents.commands._format import event_type

pytestmark = pytest.mark.kafka


@dataclass
class Stream:
    bootstrap: str
    topic: str
    produced: Produced
    truth_file: Path
    malformed_offset: tuple[int, int] | None = None


@pytest.fixture(scope="module")
def stream(kafka_bootstrap: str, tmp_path_factory: pytest.TempPathFactory) -> Stream:
    topic = f"cli-stream-{uuid.uuid4().hex[:10]}"
    create_topic(kafka_bootstrap, TopicSpec(topic, partitions=2))
    produced = simulate_to_topic(kafka_bootstrap, topic, iterations=40)
    produce(kafka_bootstrap, topic, [(b"junk", b"not an avro batch")])
    truth_file = tmp_path_factory.mktemp("truth") / "truth.jsonl"
    truth_file.write_text("".join(json.dumps(t.to_json()) + "\n" for t in produced.truths))
    return Stream(kafka_bootstrap, topic, produced, truth_file)


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def cli(*argv: str) -> list[str]:
    return [sys.executable, "-m", "kvevents.cli", *argv]


def chain_tokens(truth: GroundTruth) -> tuple[list[int], int]:
    """The tokens of the longest chain of blocks the worker holds (root first), and its length."""
    held = next(iter(truth.windows.values()))
    best: list[int] = []
    for h in held:
        chain = [h]
        while (parent := held[chain[-1]].parent_hash) is not None and parent in held:
            chain.append(parent)
        if held[chain[-1]].parent_hash is None and len(chain) > len(best):
            best = chain
    tokens = [t for h in reversed(best) for t in held[h].tokens]
    return tokens, len(best)


def new_instance_batch(name: str, tokens: list[int]) -> EventBatch:
    blocks = [
        KVCacheStoredBlockData(1000 + i, tokens[i * BLOCK_SIZE : (i + 1) * BLOCK_SIZE])
        for i in range(len(tokens) // BLOCK_SIZE)
    ]
    events = [
        KVCacheEvent(0, KVCacheCreatedData([64, 0]), 8192, 0),
        KVCacheEvent(1, KVCacheStoredData(None, blocks), 8192, 0),
    ]
    return EventBatch(name, events, producer_id=3, sequence=0, created_at_us=time.time_ns() // 1000)


# ---------------------------------------------------------------------------------------- tail


def test_tail_prints_every_event_and_reports_the_malformed_message(
    stream: Stream, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = run(
        capsys,
        "tail",
        "-b",
        stream.bootstrap,
        "-t",
        stream.topic,
        "--from-beginning",
        "--no-follow",
        "--json",
    )
    assert code == 0
    rows = [json.loads(line) for line in out.splitlines()]
    events = [r for r in rows if r["kind"] == "event"]
    assert len(events) == stream.produced.events
    assert sum(1 for r in rows if r["kind"] == "batch") == len(stream.produced.sent)
    sent = Counter(
        (b.instance_id, e.attention_dp_rank, e.event_id) for b in stream.produced.sent for e in b.events
    )
    assert Counter((r["instance_id"], r["attention_dp_rank"], r["event_id"]) for r in events) == sent
    assert f"malformed message at {stream.topic}[" in err and "(key 'junk')" in err
    assert "1 malformed message(s)" in err


def test_tail_filters(stream: Stream, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(
        capsys, "tail", "-b", stream.bootstrap, "-t", stream.topic, "--from-beginning", "--no-follow",
        "--instance", "sim-b", "--rank", "1", "--type", "updated", "--type", "removed", "--no-batches",
    )  # fmt: skip
    assert code == 0
    expected = sum(
        1 for b in stream.produced.sent for e in b.events
        if b.instance_id == "sim-b" and e.attention_dp_rank == 1 and event_type(e) in ("updated", "removed")
    )  # fmt: skip
    lines = out.splitlines()
    assert expected > 0 and len(lines) == expected
    assert all(" sim-b r1 " in line and (" updated " in line or " removed " in line) for line in lines)


def test_tail_follows_new_events_and_stops_at_count(stream: Stream) -> None:
    topic = f"cli-follow-{uuid.uuid4().hex[:8]}"
    create_topic(stream.bootstrap, TopicSpec(topic))
    proc = subprocess.Popen(
        cli("tail", "-b", stream.bootstrap, "-t", topic, "--count", "3", "--no-batches"),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        seq = 0
        while proc.poll() is None and time.monotonic() < deadline:  # produce until it has seen 3
            batch = new_instance_batch(f"live-{seq}", list(range(48)))
            produce(stream.bootstrap, topic, [batch])
            seq += 1
            time.sleep(0.5)
        out, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    lines = out.splitlines()
    assert len(lines) == 3 and " created " in lines[0] and " stored " in lines[1]
    assert "3 event(s) shown" in err


def test_tail_stops_cleanly_on_ctrl_c(stream: Stream) -> None:
    proc = subprocess.Popen(
        cli("tail", "-b", stream.bootstrap, "-t", stream.topic),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    time.sleep(4)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 130, err
    assert "(interrupted)" in err and "Traceback" not in err


# --------------------------------------------------------------------------------------- index


def test_index_rebuilds_verifies_and_saves_checkpoints(
    stream: Stream, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    base = ("-b", stream.bootstrap, "-t", stream.topic)
    ckpt = tmp_path / "idx.ckpt"
    code, out, _ = run(
        capsys, "index", *base, "--verify", str(stream.truth_file), "--save-checkpoint", str(ckpt), "--json"
    )
    assert code == 0
    report = json.loads(out)
    assert report["verify"]["equal"] is True and len(report["verify"]["workers"]) == 4
    summary = report["summary"]
    assert summary["workers"] == 4 and summary["degraded_workers"] == 0 and summary["malformed"] == 1
    assert summary["rebuild"]["events"] == stream.produced.events and summary["lag_messages"] == 0
    assert ckpt.exists() and "checkpoint saved to" in report["checkpoints"][0]
    levels: Counter[int] = Counter()
    for row in report["workers"]:
        levels.update({int(k): v for k, v in row["blocks_by_level"].items()})
    truth_levels = Counter(
        b.cache_level for t in stream.produced.truths for w in t.windows.values() for b in w.values()
    )
    assert levels == truth_levels and truth_levels[1] > 0

    code, out, _ = run(capsys, "index", *base, "--checkpoint", str(ckpt), "--verify", str(stream.truth_file))
    assert code == 0
    assert (
        f"from checkpoint file {ckpt}: 0 messages" in out
        and "verify: index equals the ground truth: 4/4 workers equal" in out
    )

    checkpoints = f"cli-ckpt-{uuid.uuid4().hex[:8]}"
    code, out, _ = run(capsys, "index", *base, "--checkpoint-topic", checkpoints, "--json")
    assert code == 0 and "saved to topic" in json.loads(out)["checkpoints"][0]
    code, out, _ = run(capsys, "index", *base, "--checkpoint-topic", checkpoints, "--json")
    again = json.loads(out)
    assert code == 0 and again["summary"]["source"] == f"checkpoint 'default' in topic {checkpoints!r}"
    assert (
        again["summary"]["rebuild"]["messages"] == 0
        and again["summary"]["held_blocks"] == summary["held_blocks"]
    )


def test_index_verify_fails_on_a_different_truth(
    stream: Stream, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    lines = stream.truth_file.read_text().splitlines()
    first = json.loads(lines[0])
    window = next(iter(first["windows"]))
    first["windows"][window] = first["windows"][window][1:]  # forget one block
    wrong = tmp_path / "wrong.jsonl"
    wrong.write_text("\n".join([json.dumps(first), *lines[1:]]) + "\n")
    code, out, _ = run(capsys, "index", "-b", stream.bootstrap, "-t", stream.topic, "--verify", str(wrong))
    assert code == 1
    assert "verify: index DIFFERS from the ground truth: 3/4 workers equal" in out
    assert f"window {window}: extra [0x" in out


def test_index_tail_redraws_the_table_until_the_duration(
    stream: Stream, capsys: pytest.CaptureFixture[str]
) -> None:
    started = time.monotonic()
    code, out, _ = run(
        capsys,
        "index",
        "-b",
        stream.bootstrap,
        "-t",
        stream.topic,
        "--tail",
        "--duration",
        "2",
        "--refresh",
        "0.5",
    )
    assert code == 0 and 2 <= time.monotonic() - started < 30
    assert out.count("instance             rank") >= 3  # at least two redraws and the final table
    assert "sim-a" in out and "lag 0 msgs" in out


def test_index_tail_stops_on_ctrl_c_and_saves_its_checkpoint(stream: Stream, tmp_path: Path) -> None:
    ckpt = tmp_path / "tail.ckpt"
    proc = subprocess.Popen(
        cli("index", "-b", stream.bootstrap, "-t", stream.topic, "--tail", "--refresh", "0.3",
            "--checkpoint", str(ckpt), "--save-checkpoint", str(ckpt)),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        while "worker(s)" not in (line := proc.stdout.readline()):  # the first table is drawn: tailing
            assert line, proc.stderr.read() if proc.stderr else "no output"
        proc.send_signal(signal.SIGINT)
        rest, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 130, err
    assert (
        "interrupted: the index holds what was applied before Ctrl-C" in rest
        and "checkpoint saved to" in rest
    )
    from kvevents.consumer import load_checkpoint

    checkpoint = load_checkpoint(ckpt, topic=stream.topic)
    assert checkpoint.messages == len(stream.produced.sent) + 1  # every message, the malformed one too


def test_index_of_a_missing_topic_is_a_clear_error(
    stream: Stream, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = run(capsys, "index", "-b", stream.bootstrap, "-t", f"nope-{uuid.uuid4().hex[:6]}")
    assert code == 1 and err.startswith("kvevents index: topic 'nope-")


# --------------------------------------------------------------------------------------- route


def test_route_token_file_picks_the_worker_holding_the_prefix(
    stream: Stream, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    prompts = tmp_path / "prompts.txt"
    chains = [chain_tokens(t) for t in stream.produced.truths]
    prompts.write_text(
        "# one chain per worker\n" + "".join(" ".join(map(str, tokens)) + "\n" for tokens, _ in chains)
    )
    code, out, _ = run(capsys, "route", "-b", stream.bootstrap, "-t", stream.topic, "--tokens", str(prompts),
                       "--block-size", str(BLOCK_SIZE), "--json")  # fmt: skip
    assert code == 0
    results = json.loads(out)["prompts"]
    assert len(results) == 4
    for (tokens, length), result in zip(chains, results, strict=True):
        truth_hits = {t.worker: t.prefix_hit_blocks(tokens) for t in stream.produced.truths}
        assert length > 0 and result["best"]["matched_blocks"] == length == max(truth_hits.values())
        best = (result["best"]["instance_id"], result["best"]["attention_dp_rank"])
        assert truth_hits[best] == length
        assert {
            (s["instance_id"], s["attention_dp_rank"]): s["matched_blocks"] for s in result["scores"]
        } == {w: n for w, n in truth_hits.items() if n}


def test_route_synthetic_requests_score_as_the_ground_truth(
    stream: Stream, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, _ = run(capsys, "route", "-b", stream.bootstrap, "-t", stream.topic, "--synthetic", "8", "--seed", "1",
                       "--block-size", str(BLOCK_SIZE), "--json")  # fmt: skip
    assert code == 0
    report = json.loads(out)
    from kvevents.producer.simulator.workload import WorkloadConfig, WorkloadGenerator

    requests = WorkloadGenerator(WorkloadConfig(seed=1)).held_out(8, 1)
    hits = 0
    for request, result in zip(requests, report["prompts"], strict=True):
        truth_best = max(t.prefix_hit_blocks(request.prompt, request.lora_id) for t in stream.produced.truths)
        assert (result["best"] or {"matched_blocks": 0})["matched_blocks"] == truth_best
        hits += truth_best > 0
    assert hits > 0 and report["summary"]["prompts_with_a_hit"] == hits


def http(url: str, body: dict[str, Any] | bytes | None = None) -> tuple[int, dict[str, Any]]:
    data = json.dumps(body).encode() if isinstance(body, dict) else body
    request = urllib.request.Request(url, data=data, method="GET" if data is None else "POST")
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_route_serve_answers_http_and_keeps_following(stream: Stream) -> None:
    topic = f"cli-serve-{uuid.uuid4().hex[:8]}"
    create_topic(stream.bootstrap, TopicSpec(topic))
    truth = stream.produced.truths[0]
    tokens, length = chain_tokens(truth)
    produce(stream.bootstrap, topic, stream.produced.sent)
    proc = subprocess.Popen(
        cli("route", "-b", stream.bootstrap, "-t", topic, "--serve", "--port", "0", "--block-size", str(BLOCK_SIZE)),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        first = proc.stdout.readline()
        assert first.startswith("serving on http://"), proc.stderr.read() if proc.stderr else first
        url = first.split()[2]
        status, body = http(url + "/match", {"token_ids": tokens, "block_size": BLOCK_SIZE, "lora_id": None})
        assert status == 200 and body["best"]["matched_blocks"] == length
        assert truth.prefix_hit_blocks(tokens) == length
        assert body["scores"] == sorted(
            body["scores"],
            key=lambda s: (-s["score"], -s["matched_blocks"], s["instance_id"], s["attention_dp_rank"]),
        )
        status, body = http(url + "/match", b'{"token_ids": [1, 2,')
        assert status == 400 and "bad /match body" in body["error"]
        status, body = http(url + "/healthz")
        assert status == 200 and body["status"] == "ok"
        status, body = http(url + "/readyz")
        assert status == 200 and body["ready"] and body["follower_alive"] and body["broker_ok"]

        late_tokens = list(range(5000, 5000 + 3 * BLOCK_SIZE))
        produce(stream.bootstrap, topic, [new_instance_batch("late", late_tokens)])
        deadline = time.monotonic() + 30
        best = None
        while time.monotonic() < deadline:
            status, body = http(url + "/match", {"token_ids": late_tokens, "block_size": BLOCK_SIZE})
            best = body["best"]
            if best is not None:
                break
            time.sleep(0.2)
        assert best is not None and (best["instance_id"], best["matched_blocks"]) == ("late", 3)
        status, body = http(url + "/workers")
        assert "late" in {w["instance_id"] for w in body["workers"]}
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            _, err = proc.communicate(timeout=30)
        finally:
            proc.kill()
    assert proc.returncode == 0, err  # a graceful stop
    assert re.search(r"process 0: stopped; [\d,]+ events read while serving", err), err


# --------------------------------------------------------------------------------------- stats


def test_stats_counts_the_stream_and_plots_the_rates(
    stream: Stream, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    png = tmp_path / "rates.png"
    code, out, err = run(
        capsys, "stats", "-b", stream.bootstrap, "-t", stream.topic, "--json", "--plot", str(png)
    )
    assert code == 0
    report = json.loads(out)
    expected = Counter(event_type(e) for b in stream.produced.sent for e in b.events)
    assert report["events"] == {t: expected[t] for t in ("created", "stored", "removed", "updated")}
    assert report["range"]["batches"] == len(stream.produced.sent) and report["range"]["malformed"] == 1
    offloads = sum(s.stats().offloads for s in stream.produced.simulators)
    assert report["level_moves"]["primary_to_secondary"] == offloads > 0
    removed = sum(s.stats().removed_blocks for s in stream.produced.simulators)
    assert report["blocks"]["removed"] == removed
    assert (
        report["drops_and_gaps"]["dropped_events"] == 0 and report["drops_and_gaps"]["event_ids_skipped"] == 0
    )
    assert report["prefix_reuse"]["already_stored_by_another_worker"] > 0  # shared system prompts
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000
    assert "malformed message at" in err

    code, out, _ = run(
        capsys,
        "stats",
        "-b",
        stream.bootstrap,
        "-t",
        stream.topic,
        "--since",
        "2100-01-01T00:00:00Z",
        "--json",
    )
    assert code == 0 and json.loads(out)["range"]["batches"] == 0
    code, out, _ = run(capsys, "stats", "-b", stream.bootstrap, "-t", stream.topic, "--since", "1h")
    assert code == 0 and f"{len(stream.produced.sent):,} batches" in out
