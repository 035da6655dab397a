"""The live bridge on real sockets and a real broker: fake engines (PUB per rank, replay ROUTER)
driven through gaps, replay, unrecoverable gaps, restarts and queue overflow; the index rebuilt
from the topic equals each engine's true cache, or exactly the affected workers are degraded."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from typing import Any

import pytest
import zmq  # the bridge extra is in dev
from bridge_engines import FakeEnginePublisher, TrueCacheEngine, wait_for
from kvevents.consumer import CacheIndex, EventReader, WorkerKey
from kvevents.producer import KafkaEventSink
from kvevents.producer.bridge.live import ZmqBridge

INSTANCE = "engine-a"


def free_ports(n: int) -> int:
    """A base port with ``n`` free consecutive ports after it (rank r at base + r)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + n >= 65535:
            continue
        ok = True
        for p in range(base, base + n):
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", p))
                except OSError:
                    ok = False
                    break
        if ok:
            return base
    raise RuntimeError("no free ports")


class Rig:
    """dp engine ranks (publishers + true caches) and one bridge + sink into ``topic``."""

    def __init__(
        self,
        bootstrap: str,
        topic: str,
        dp: int,
        *,
        replay: bool,
        reply_frames: int = 3,
        buffer_steps: int = 10_000,
        replay_drop: tuple[int, int] | None = None,
        kind: str = "vllm",
        **bridge_opts: Any,
    ) -> None:
        self.ctx = zmq.Context()
        self.bootstrap, self.topic, self.dp = bootstrap, topic, dp
        self.pub_base = free_ports(dp)
        self.replay_base = free_ports(dp) if replay else None
        self.engines = [TrueCacheEngine(kind, r, seed=100 + r) for r in range(dp)]
        self.pubs = [
            FakeEnginePublisher(
                self.ctx,
                f"tcp://127.0.0.1:{self.pub_base + r}",
                None if self.replay_base is None else f"tcp://127.0.0.1:{self.replay_base + r}",
                buffer_steps=buffer_steps,
                reply_frames=reply_frames,
                replay_drop=replay_drop,
            )
            for r in range(dp)
        ]
        self.kind = kind.split("-")[0]
        self.bridge_opts = bridge_opts
        self.bridge: ZmqBridge | None = None
        self.sink: KafkaEventSink | None = None

    def start_bridge(self) -> None:
        self.bridge = ZmqBridge(
            self.kind,
            f"tcp://127.0.0.1:{self.pub_base}",
            dp_size=self.dp,
            replay_endpoint=None if self.replay_base is None else f"tcp://127.0.0.1:{self.replay_base}",
            ctx=self.ctx,
            **self.bridge_opts,
        )
        self.sink = KafkaEventSink(
            self.bridge,
            self.topic,
            INSTANCE,
            config={"bootstrap.servers": self.bootstrap},
            attention_dp_size=self.dp,
            on_delivery=self.bridge.on_delivery,
        )

    def send(self, rank: int, n: int = 1, *, publish: bool = True) -> None:
        for _ in range(n):
            self.pubs[rank].send(self.engines[rank].batch(), publish=publish)

    def settle(self) -> None:
        assert self.bridge is not None and self.sink is not None
        want = {r: p.seq - 1 for r, p in enumerate(self.pubs)}
        assert wait_for(lambda: all(self.bridge.last_seq[r] == s for r, s in want.items() if s >= 0), 30)
        assert self.sink.wait_delivered(30)

    def index(self) -> CacheIndex:
        index = CacheIndex()
        with EventReader(self.bootstrap, self.topic) as reader:
            reader.apply_to(index)
        return index

    def close(self) -> None:
        if self.bridge is not None:
            self.bridge.close()
        if self.sink is not None:
            self.sink.close(10)
        for p in self.pubs:
            p.close()
        self.ctx.term()


def held(index: CacheIndex, rank: int) -> dict[int, int]:
    return {b.block_hash: b.cache_level for b in index.worker_blocks(WorkerKey(INSTANCE, rank), 0)}


def check(rig: Rig, degraded: set[int]) -> CacheIndex:
    index = rig.index()
    assert {k.attention_dp_rank for k in index.degraded_workers()} == degraded
    for r, engine in enumerate(rig.engines):
        if r not in degraded:
            assert held(index, r) == engine.truth(), f"rank {r}"
    return index


@pytest.fixture
def rigs(kafka_bootstrap: str) -> Iterator[list[Rig]]:
    made: list[Rig] = []
    yield made
    for rig in made:
        rig.close()


def wait_subscribed(rig: Rig) -> None:
    """Publish nothing until the SUBs are connected (ZMQ's slow joiner)."""
    import time

    time.sleep(0.4)


@pytest.mark.parametrize(("kind", "reply_frames"), [("vllm", 2), ("vllm-positional", 3), ("sglang", 3)])
def test_gaps_are_filled_by_replay(
    rigs: list[Rig], kafka_bootstrap: str, kafka_topic: str, kind: str, reply_frames: int
) -> None:
    rig = Rig(kafka_bootstrap, kafka_topic, 2, replay=True, reply_frames=reply_frames, kind=kind)
    rigs.append(rig)
    rig.start_bridge()
    wait_subscribed(rig)
    for step in range(60):
        rig.send(0)
        rig.send(1, publish=step % 7 != 3)  # every 7th batch of rank 1 never reaches the SUB
    rig.send(1)
    rig.settle()
    assert (
        rig.bridge is not None
        and rig.bridge.counts["replays"] >= 8
        and rig.bridge.counts["batches_lost"] == 0
    )
    check(rig, degraded=set())


def test_unrecoverable_gap_degrades_exactly_that_worker(
    rigs: list[Rig], kafka_bootstrap: str, kafka_topic: str
) -> None:
    rig = Rig(kafka_bootstrap, kafka_topic, 2, replay=True, buffer_steps=3)
    rigs.append(rig)
    rig.start_bridge()
    wait_subscribed(rig)
    rig.send(0, 20)
    rig.send(1, 5)
    rig.send(1, 10, publish=False)  # 10 missed; the engine keeps only its last 3 batches
    rig.send(1, 5)
    rig.send(0, 5)
    rig.settle()
    assert rig.bridge is not None and 7 <= rig.bridge.counts["batches_lost"] <= 10
    check(rig, degraded={1})


def test_engine_restart_is_created_and_index_follows(
    rigs: list[Rig], kafka_bootstrap: str, kafka_topic: str
) -> None:
    rig = Rig(kafka_bootstrap, kafka_topic, 1, replay=True)
    rigs.append(rig)
    rig.start_bridge()
    wait_subscribed(rig)
    rig.send(0, 30)
    rig.settle()
    rig.pubs[0].restart()
    rig.engines[0].restart()
    rig.send(0, 12)
    rig.settle()
    assert rig.bridge is not None and rig.bridge.counts["engine_restarts"] == 1
    check(rig, degraded=set())


def test_joining_mid_stream_without_replay_is_a_loss(
    rigs: list[Rig], kafka_bootstrap: str, kafka_topic: str
) -> None:
    rig = Rig(kafka_bootstrap, kafka_topic, 2, replay=False)
    rigs.append(rig)
    rig.send(1, 5)  # before the bridge runs: nobody receives these
    rig.start_bridge()
    wait_subscribed(rig)
    rig.send(0, 10)
    rig.send(1, 10)
    rig.settle()
    check(rig, degraded={1})


def test_queue_overflow_is_counted_and_recovered_by_replay(
    rigs: list[Rig], kafka_bootstrap: str, kafka_topic: str
) -> None:
    rig = Rig(kafka_bootstrap, kafka_topic, 1, replay=True, max_queued=8, rcvhwm=16)
    rigs.append(rig)
    rig.start_bridge()
    wait_subscribed(rig)
    rig.send(0, 3000)
    rig.settle()
    assert rig.bridge is not None
    stats = rig.bridge.stats()
    assert sum(stats["queue_dropped_by_rank"].values()) > 0 and stats["replays"] > 0
    assert rig.bridge.counts["batches_lost"] == 0
    check(rig, degraded=set())


def test_replay_answer_with_holes_is_asked_again(
    rigs: list[Rig], kafka_bootstrap: str, kafka_topic: str
) -> None:
    """Seqs missing in the middle of a replay answer were dropped on the way (a ROUTER past its
    high-water mark drops them while its reader lags; the end marker still comes), not forgotten
    by the engine: asked again from the first one missing, nothing is lost."""
    rig = Rig(kafka_bootstrap, kafka_topic, 1, replay=True, replay_drop=(5, 25))
    rigs.append(rig)
    rig.start_bridge()
    wait_subscribed(rig)
    rig.send(0, 10)
    rig.send(0, 60, publish=False)  # seqs 10..69: the answer from 10 lacks 15..34, the next ones less
    rig.send(0, 10)
    rig.settle()
    assert rig.bridge is not None
    assert rig.bridge.counts["batches_lost"] == 0
    assert rig.bridge.counts["replays_with_holes"] >= 1
    check(rig, degraded=set())
