"""The live index and ``route --serve`` against the real broker: liveness (stale after the TTL,
closed on the sink's close header), /readyz when the follower fails and comes back, two
replicas answering alike, the sink's heartbeats, and SIGTERM/SIGINT writing a checkpoint that
equals a full replay (``route --serve`` with 1 and 2 processes, ``index --tail``)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import uuid
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from cli_streams import BLOCK_SIZE, simulate_to_topic
from confluent_kafka import Consumer, Producer, TopicPartition
from kafka_streams import produce
from kvevents.consumer import CacheIndex, EventReader, LiveIndex, load_checkpoint
from kvevents.consumer.liveness import CONTROL_HEADER
from kvevents.consumer.topics import TopicSpec, create_topic
from kvevents.producer import KVCacheEventManager
from kvevents.producer.sink import CONTROL_HEADER as SINK_CONTROL_HEADER
from kvevents.producer.sink import KafkaEventSink
from kvevents.schemas import (
    EventBatch,
    KVCacheCreatedData,
    KVCacheEvent,
    KVCacheStoredBlockData,
    KVCacheStoredData,
    decode_batch,
    encode_batch,
)

from kvevents.commands._route_http import ServeOptions, bind, make_server

pytestmark = pytest.mark.kafka

TOKENS = list(range(7000, 7000 + 3 * BLOCK_SIZE))
WINDOW = 8192


def stored_batch(name: str, sequence: int = 0) -> EventBatch:
    blocks = [
        KVCacheStoredBlockData(900 + i, TOKENS[i * BLOCK_SIZE : (i + 1) * BLOCK_SIZE]) for i in range(3)
    ]
    events = [
        KVCacheEvent(0, KVCacheCreatedData([64, 0]), WINDOW, 0),
        KVCacheEvent(1, KVCacheStoredData(None, blocks), WINDOW, 0),
    ]
    return EventBatch(
        name, events, producer_id=producer_of(name), sequence=sequence, created_at_us=time.time_ns() // 1000
    )


def heartbeat(name: str, sequence: int) -> EventBatch:
    return EventBatch(
        name, [], producer_id=producer_of(name), sequence=sequence, created_at_us=time.time_ns() // 1000
    )


def producer_of(name: str) -> int:
    """One producer session per instance (a session id shared by two instances is a conflict)."""
    return zlib.crc32(name.encode()) + 1


def produce_with_headers(
    bootstrap: str, topic: str, batch: EventBatch, headers: list[tuple[str, bytes]]
) -> None:
    p = Producer({"bootstrap.servers": bootstrap})
    p.produce(topic, encode_batch(batch), batch.instance_id.encode(), headers=headers)
    assert p.flush(30) == 0


def wait_for(predicate: Callable[[], Any], timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"not within {timeout} s: {what}")


def http(url: str, payload: object | None = None) -> tuple[int, dict[str, Any]]:
    data = None if payload is None else json.dumps(payload).encode()
    request = urllib.request.Request(url, data, method="POST" if data is not None else "GET")
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


@contextmanager
def serving(live: LiveIndex) -> Iterator[str]:
    """``live`` served over HTTP on a free port (uvicorn in a thread); yields the URL."""
    sock = bind("127.0.0.1", 0)
    server = make_server(sock, live, ServeOptions(block_size=BLOCK_SIZE))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    wait_for(lambda: server.started, 10, "the server listens")
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()


def chain_tokens(truth: Any) -> list[int]:
    """The tokens of the longest chain of blocks a worker holds, root first."""
    held = next(iter(truth.windows.values()))
    best: list[int] = []
    for h in held:
        chain = [h]
        while (parent := held[chain[-1]].parent_hash) is not None and parent in held:
            chain.append(parent)
        if held[chain[-1]].parent_hash is None and len(chain) > len(best):
            best = chain
    return [t for h in reversed(best) for t in held[h].tokens]


def full_replay(bootstrap: str, topic: str) -> CacheIndex:
    index = CacheIndex()
    with EventReader(bootstrap, topic) as reader:
        reader.apply_to(index)
    return index


def test_stale_workers_leave_routing_after_the_ttl_and_closed_ones_leave_the_index(
    kafka_bootstrap: str, kafka_topic: str
) -> None:
    produce(kafka_bootstrap, kafka_topic, [stored_batch("quiet"), stored_batch("chatty")])
    live = LiveIndex(kafka_bootstrap, kafka_topic, stale_after_s=2.0)
    live.start()
    with live, serving(live) as url:
        status, body = http(url + "/match", {"token_ids": TOKENS})
        assert status == 200 and {s["instance_id"] for s in body["scores"]} == {"quiet", "chatty"}
        assert body["left_out"] == []
        sequence = 1
        deadline = time.monotonic() + 3.0
        while time.monotonic() < deadline:  # only "chatty" sends heartbeats (batches with no events)
            produce(kafka_bootstrap, kafka_topic, [heartbeat("chatty", sequence)])
            sequence += 1
            time.sleep(0.5)
        status, body = http(url + "/match", {"token_ids": TOKENS})
        assert [s["instance_id"] for s in body["scores"]] == ["chatty"]
        assert body["left_out"] == [
            {"instance_id": "quiet", "attention_dp_rank": 0, "state": "stale", "matched_blocks": 3}
        ]
        workers = {w["instance_id"]: w for w in http(url + "/workers")[1]["workers"]}
        assert workers["quiet"]["state"] == "stale" and not workers["quiet"]["degraded"]  # distinct states
        assert workers["chatty"]["state"] == "live"

        produce_with_headers(
            kafka_bootstrap, kafka_topic, heartbeat("chatty", sequence), [(CONTROL_HEADER, b"close")]
        )
        wait_for(lambda: live.liveness.state("chatty") == "closed", 10, "chatty closed")
        status, body = http(url + "/match", {"token_ids": TOKENS})
        assert body["scores"] == [] and body["best"] is None
        workers = {w["instance_id"]: w for w in http(url + "/workers")[1]["workers"]}
        assert workers["chatty"]["state"] == "closed" and workers["chatty"]["blocks"] == 0
        metrics = urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()
        assert 'kvevents_index_liveness_workers{process="0",state="closed"} 1' in metrics
        assert 'kvevents_index_liveness_workers{process="0",state="stale"} 1' in metrics


def test_readyz_flips_when_the_follower_fails_and_back_when_it_restarts(
    kafka_bootstrap: str, kafka_topic: str
) -> None:
    produce(kafka_bootstrap, kafka_topic, [stored_batch("a")])
    live = LiveIndex(kafka_bootstrap, kafka_topic, restart_after_s=2.0, probe_interval_s=0.3)
    live.start()
    with live, serving(live) as url:
        wait_for(lambda: http(url + "/readyz")[0] == 200, 10, "ready")
        reader = live.reader

        def broken(*args: Any, **kwargs: Any) -> Any:
            raise RuntimeError("injected follower failure")

        reader.apply_to = broken  # type: ignore[method-assign]
        failed_at = time.monotonic()
        _status, body = wait_for(lambda: (r := http(url + "/readyz"))[0] == 503 and r, 5, "503")
        assert time.monotonic() - failed_at < 3
        assert (
            not body["ready"]
            and not body["follower_alive"]
            and "injected follower failure" in body["reasons"][0]
        )
        wait_for(lambda: http(url + "/readyz")[0] == 200, 10, "ready again")
        assert live.reader is not reader and live.failures == 1
        produce(kafka_bootstrap, kafka_topic, [stored_batch("b")])  # the restarted follower applies it
        wait_for(lambda: http(url + "/match", {"token_ids": TOKENS})[1]["best"] is not None
                 and len(http(url + "/match", {"token_ids": TOKENS})[1]["scores"]) == 2, 10, "b applied")  # fmt: skip


def test_two_replicas_on_one_topic_answer_identically(
    kafka_bootstrap: str, kafka_topic_factory: Callable[..., str]
) -> None:
    topic = kafka_topic_factory(partitions=2)
    produced = simulate_to_topic(kafka_bootstrap, topic, iterations=20)
    replicas = [LiveIndex(kafka_bootstrap, topic) for _ in range(2)]
    for r in replicas:
        r.start()
    more = simulate_to_topic(kafka_bootstrap, topic, instances=("sim-c",), iterations=10)  # while both follow
    total = len(produced.sent) + len(more.sent)
    try:
        with serving(replicas[0]) as url0, serving(replicas[1]) as url1:
            for r in replicas:
                wait_for(
                    lambda r=r: r.metrics() is not None and r.metrics().messages_total >= total,
                    20,
                    "caught up",
                )  # type: ignore[misc,union-attr]
            with replicas[0].lock, replicas[1].lock:
                assert replicas[0].index.to_bytes() == replicas[1].index.to_bytes()
            asked = 0
            for truth in produced.truths + more.truths:
                tokens = chain_tokens(truth)
                if not tokens:
                    continue
                assert http(url0 + "/match", {"token_ids": tokens}) == http(
                    url1 + "/match", {"token_ids": tokens}
                )
                asked += 1
            assert asked >= 4
            rows = [http(url + "/workers")[1]["workers"] for url in (url0, url1)]
            for row in rows[0] + rows[1]:
                del row["seconds_since_heard"]  # asked a moment apart
            assert rows[0] == rows[1]
    finally:
        for r in replicas:
            r.close()


def test_the_sink_sends_heartbeats_when_idle_and_says_close_last(
    kafka_bootstrap: str, kafka_topic: str
) -> None:
    assert SINK_CONTROL_HEADER == CONTROL_HEADER
    with KVCacheEventManager(1000) as manager:
        sink = KafkaEventSink(manager, kafka_topic, "engine-hb", config={"bootstrap.servers": kafka_bootstrap},
                              heartbeat_s=0.3)  # fmt: skip
        time.sleep(1.6)  # idle: about five heartbeats
        report = sink.close(10)
        assert report.clean
    consumer = Consumer(
        {"bootstrap.servers": kafka_bootstrap, "group.id": uuid.uuid4().hex, "enable.auto.commit": False}
    )
    consumer.assign([TopicPartition(kafka_topic, 0, 0)])
    messages = []
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        m = consumer.poll(0.5)
        if m is not None and m.error() is None:
            messages.append(m)
        elif m is None and messages:
            break
    consumer.close()
    batches = [decode_batch(m.value()) for m in messages]
    assert len(batches) >= 4 and all(b.events == [] and b.instance_id == "engine-hb" for b in batches)
    assert [b.sequence for b in batches] == list(range(len(batches)))  # heartbeats are ordinary batches
    assert all(CONTROL_HEADER not in dict(m.headers() or []) for m in messages[:-1])
    assert dict(messages[-1].headers() or [])[CONTROL_HEADER] == b"close"
    live = LiveIndex(kafka_bootstrap, kafka_topic)
    live.start()
    with live:
        assert live.liveness.state("engine-hb") == "closed"


def cli(*argv: str) -> list[str]:
    return [sys.executable, "-m", "kvevents.cli", *argv]


@pytest.mark.slow
@pytest.mark.parametrize(("sig", "workers"), [(signal.SIGTERM, 1), (signal.SIGINT, 2), (signal.SIGTERM, 2)])
def test_route_serve_saves_on_signal_a_checkpoint_equal_to_a_full_replay(
    kafka_bootstrap: str, kafka_topic_factory: Callable[..., str], tmp_path: Path, sig: int, workers: int
) -> None:
    topic = kafka_topic_factory(partitions=2)
    simulate_to_topic(kafka_bootstrap, topic, iterations=15)
    ckpt = tmp_path / "serve.ckpt"
    proc = subprocess.Popen(
        cli("route", "-b", kafka_bootstrap, "-t", topic, "--serve", "--port", "0", "--workers", str(workers),
            "--block-size", str(BLOCK_SIZE), "--save-checkpoint", str(ckpt), "-q"),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        first = proc.stdout.readline()
        assert first.startswith("serving on http://"), proc.stderr.read() if proc.stderr else first
        url = first.split()[2]
        wait_for(lambda: _ok(url + "/readyz"), 20, "ready")
        more = simulate_to_topic(
            kafka_bootstrap, topic, instances=("sim-late",), iterations=10
        )  # served live
        assert more.sent
        time.sleep(1.5)
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    assert "checkpoint saved to" in err, err
    checkpoint = load_checkpoint(ckpt, topic=topic)
    replay = full_replay(kafka_bootstrap, topic)
    assert "sim-late" in {k.instance_id for k in replay.workers()}
    assert checkpoint.index().same_state(replay)


def _ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return bool(response.status == 200)
    except (urllib.error.URLError, OSError):
        return False


def test_index_tail_saves_its_checkpoint_on_sigterm(
    kafka_bootstrap: str, kafka_topic: str, tmp_path: Path
) -> None:
    simulate_to_topic(kafka_bootstrap, kafka_topic, iterations=10)
    ckpt = tmp_path / "tail.ckpt"
    proc = subprocess.Popen(
        cli("index", "-b", kafka_bootstrap, "-t", kafka_topic, "--tail", "--refresh", "0.3", "--save-checkpoint", str(ckpt)),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        while "worker(s)" not in (line := proc.stdout.readline()):
            assert line, proc.stderr.read() if proc.stderr else "no output"
        simulate_to_topic(kafka_bootstrap, kafka_topic, instances=("sim-late",), iterations=5)
        time.sleep(1.0)
        proc.send_signal(signal.SIGTERM)
        rest, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 130, err
    assert "checkpoint saved to" in rest
    assert (
        load_checkpoint(ckpt, topic=kafka_topic).index().same_state(full_replay(kafka_bootstrap, kafka_topic))
    )


@pytest.mark.slow
def test_readyz_flips_when_the_broker_dies_and_back_when_it_returns(tmp_path: Path) -> None:
    from kvevents.broker import LocalBroker
    from kvevents.broker.config import choose_ports

    ports = choose_ports()
    broker = LocalBroker(
        tmp_path / "broker", port=ports.client, controller_port=ports.controller, stop_with_parent=True
    )
    broker.start()
    try:
        bootstrap = broker.bootstrap_servers
        topic = f"readyz-{uuid.uuid4().hex[:8]}"
        create_topic(bootstrap, TopicSpec(topic))
        produce(bootstrap, topic, [stored_batch("a")])
        live = LiveIndex(bootstrap, topic, probe_interval_s=0.5, probe_timeout_s=1.0,
                         config={"reconnect.backoff.max.ms": 500})  # fmt: skip
        live.start()
        with live, serving(live) as url:
            wait_for(lambda: http(url + "/readyz")[0] == 200, 10, "ready")
            broker.stop()
            stopped = time.monotonic()
            _status, body = wait_for(
                lambda: (r := http(url + "/readyz"))[0] == 503 and r, 10, "503 with the broker down"
            )
            assert time.monotonic() - stopped < 6 and not body["broker_ok"]
            assert http(url + "/healthz")[0] == 200  # the process still serves
            assert http(url + "/match", {"token_ids": TOKENS})[1]["best"]["instance_id"] == "a"  # from memory
            broker.start()
            wait_for(lambda: http(url + "/readyz")[0] == 200, 30, "ready again")
            produce(bootstrap, topic, [stored_batch("b")])
            wait_for(
                lambda: len(http(url + "/match", {"token_ids": TOKENS})[1]["scores"]) == 2, 15, "b applied"
            )
    finally:
        broker.stop()
