"""``kvevents export`` from the command line against the real broker: ``export dynamo`` writes
RouterEvent lines that Dynamo's own RadixTree accepts and that score like the index;
``export zmq --no-follow`` publishes every worker's stream to a real SUB on loopback, keeps its
seqs in a state file across two runs, and skips a malformed message with a count."""

from __future__ import annotations

import json
import socket
import threading
import time
from pathlib import Path

import pytest
import zmq
from cli_streams import BLOCK_SIZE, simulate_to_topic
from kafka_streams import producer as kafka_producer
from kvevents.consumer import CacheIndex, EventReader, WorkerKey
from kvevents.consumer.dynamo import local_block_hashes
from kvevents.producer.simulator.cache import HeldBlock

from kvevents.cli import main

pytestmark = pytest.mark.kafka


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_export_dynamo_lines_feed_dynamos_radix_tree(
    kafka_bootstrap: str, kafka_topic: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from dynamo.llm import RadixTree

    produced = simulate_to_topic(kafka_bootstrap, kafka_topic, iterations=60)
    out = tmp_path / "events.jsonl"
    code = main(
        [
            "export",
            "dynamo",
            "-b",
            kafka_bootstrap,
            "-t",
            kafka_topic,
            "--no-follow",
            "-o",
            str(out),
            "--json",
        ]
    )
    assert code == 0
    summary = json.loads(capsys.readouterr().err.strip().splitlines()[-1])
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert summary["lines"] == len(lines) > 50 and summary["clears_for_loss"] == 0
    tree = RadixTree()
    for line in lines:
        assert set(line) == {"worker_id", "event"} and set(line["event"]) == {"event_id", "data", "dp_rank"}
        tree.apply_event(line["worker_id"], json.dumps(line["event"]).encode())
    names = {v: k for k, v in summary["worker_ids"].items()}
    index = CacheIndex()
    with EventReader(kafka_bootstrap, kafka_topic) as reader:
        reader.apply_to(index)
    checked = 0
    for truth in produced.truths:
        for held in truth.windows.values():
            for block in list(held.values())[:20]:
                tokens = truth_tokens(held, block)
                ours = index.find_matches_for_tokens(tokens, BLOCK_SIZE)
                theirs = tree.find_matches(local_block_hashes(tokens, BLOCK_SIZE)).scores
                assert ours == {WorkerKey(names[w], r): n for (w, r), n in theirs.items() if n}
                checked += 1
    assert checked > 20


def truth_tokens(held: dict[int, HeldBlock], block: HeldBlock) -> list[int]:
    """The tokens of ``block``'s whole prefix, from a ground truth's blocks (walking parents)."""
    chain = [block]
    while chain[-1].parent_hash is not None and chain[-1].parent_hash in held:
        chain.append(held[chain[-1].parent_hash])
    return [t for b in reversed(chain) for t in b.tokens]


def test_export_zmq_cli_publishes_every_stream_and_keeps_seqs(
    kafka_bootstrap: str, kafka_topic: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    simulate_to_topic(kafka_bootstrap, kafka_topic, iterations=30)
    producer = kafka_producer(kafka_bootstrap)
    producer.produce(kafka_topic, key=b"sim-a", value=b"not a batch")
    producer.flush(10)
    port = _free_port()
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.connect(f"tcp://127.0.0.1:{port}")
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    received: list[list[bytes]] = []
    stop = threading.Event()

    def listen() -> None:
        while not stop.is_set():
            if sub.poll(100):
                received.append(sub.recv_multipart())

    thread = threading.Thread(target=listen)
    thread.start()
    state = tmp_path / "zmq.state"
    args = ["export", "zmq", "-b", kafka_bootstrap, "-t", kafka_topic, "--no-follow", "--json", "-q"]
    args += ["--pub", f"tcp://127.0.0.1:{port}", "--state", str(state), "--model", "m", "--wait", "0.5"]
    try:
        assert main(args) == 0
        first = json.loads(capsys.readouterr().out)
        assert main(args) == 0  # resumes from the state: nothing new to publish
        second = json.loads(capsys.readouterr().out)
        time.sleep(0.5)
    finally:
        stop.set()
        thread.join()
        sub.close(linger=0)
        ctx.term()
    assert first["malformed"] == 1 and first["clears_for_loss"] == 2  # sim-a's two ranks
    assert first["streams"] == 4 and first["batches_published"] == len(received) > 0
    assert second["messages_read"] == 0 and second["streams"] == 4
    seqs: dict[bytes, list[int]] = {}
    for topic, seq, _ in received:
        seqs.setdefault(topic, []).append(int.from_bytes(seq, "big"))
    assert sorted(seqs) == [b"kv@sim-a-dp1@m", b"kv@sim-a@m", b"kv@sim-b-dp1@m", b"kv@sim-b@m"]
    for numbers in seqs.values():
        assert numbers == list(range(len(numbers)))
    assert state.exists()
    assert list((tmp_path / "zmq.state.anchors").glob("anchor-*.bin"))  # replay anchors beside it


def test_export_dynamo_from_an_index_checkpoint(
    kafka_bootstrap: str, kafka_topic: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from kvevents.consumer import Checkpoint, save_checkpoint
    from kvevents.consumer.dynamo import router_events

    produced = simulate_to_topic(kafka_bootstrap, kafka_topic, iterations=30)
    half = len(produced.sent) // 2
    index = CacheIndex()
    with EventReader(kafka_bootstrap, kafka_topic) as reader:
        reader.apply_to(index, max_messages=half)
        save_checkpoint(tmp_path / "router.ckpt", Checkpoint.capture(index, reader))
    out = tmp_path / "after.jsonl"
    args = ["export", "dynamo", "-b", kafka_bootstrap, "-t", kafka_topic, "--no-follow", "-q", "-o", str(out)]
    assert main([*args, "--from-checkpoint", str(tmp_path / "router.ckpt")]) == 0
    expected = [event for batch in produced.sent[half:] for _, event in router_events(batch)]
    assert [json.loads(line)["event"] for line in out.read_text().splitlines()] == expected
    assert main([*args, "--from-checkpoint", str(tmp_path / "missing.ckpt")]) == 1
    assert "missing.ckpt" in capsys.readouterr().err


def test_export_dynamo_publishes_on_zmq(
    kafka_bootstrap: str, kafka_topic: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    simulate_to_topic(kafka_bootstrap, kafka_topic, iterations=20)
    endpoint = f"tcp://127.0.0.1:{_free_port()}"
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv-events")
    received: list[list[bytes]] = []
    stop = threading.Event()

    def listen() -> None:
        sub.connect(endpoint)
        while not stop.is_set():
            if sub.poll(50):
                received.append(sub.recv_multipart())

    thread = threading.Thread(target=listen)
    thread.start()
    out = tmp_path / "events.jsonl"
    try:
        args = ["export", "dynamo", "-b", kafka_bootstrap, "-t", kafka_topic, "--no-follow", "-q"]
        assert main([*args, "-o", str(out), "--zmq", endpoint, "--wait", "0.5"]) == 0
        time.sleep(0.5)
    finally:
        stop.set()
        thread.join()
        sub.close(linger=0)
        ctx.term()
    lines = out.read_bytes().splitlines()
    assert lines and [frames[1] for frames in received] == lines
    assert {frames[0] for frames in received} == {b"kv-events"}
