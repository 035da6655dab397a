"""``kvevents export zmq`` end to end on loopback: a simulated topic (real managers, offload so
there are tier moves) -> the exporter (real PUB and replay ROUTER sockets) -> an llm-d-style
subscriber: a plain pyzmq SUB that decodes vLLM's structs with msgspec (its own definitions:
the batch an array, its events positional as older llm-d decoders read them, or the current
tagged maps), tracks each topic's seq and recovers gaps with vLLM's replay protocol over a
DEALER. The subscriber's per-pod block sets
(hash, medium) must equal what kvevents' ``CacheIndex`` holds, through a forced gap and a restart
of the exporter (seqs continue from its state file)."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq
from cli_streams import simulate_to_topic
from kvevents.consumer import CacheIndex, EventReader, WorkerKey
from kvevents.consumer.export import zmq_replay
from kvevents.consumer.export.vllm_wire import medium_for_level
from kvevents.consumer.export.zmq_export import Endpoint, ZmqExportConfig, ZmqExporter, stream_topic

pytestmark = pytest.mark.kafka

END = 0xFFFF_FFFF_FFFF_FFFF


# -- vLLM's structs, as a subscriber declares them (both encodings) ---------------------------


class _Stored(msgspec.Struct):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None


class _Removed(msgspec.Struct):
    block_hashes: list[int]
    medium: str | None = None


class StoredArray(_Stored, array_like=True, tag="BlockStored"):
    pass


class RemovedArray(_Removed, array_like=True, tag="BlockRemoved"):
    pass


class ClearedArray(msgspec.Struct, array_like=True, tag="AllBlocksCleared"):
    pass


class BatchArray(msgspec.Struct, array_like=True):
    ts: float
    events: list[StoredArray | RemovedArray | ClearedArray]
    data_parallel_rank: int | None = None


class StoredMap(_Stored, tag="BlockStored"):
    pass


class RemovedMap(_Removed, tag="BlockRemoved"):
    pass


class ClearedMap(msgspec.Struct, tag="AllBlocksCleared"):
    pass


class BatchMap(msgspec.Struct, array_like=True):  # vLLM's EventBatch is an array, its events maps
    ts: float
    events: list[StoredMap | RemovedMap | ClearedMap]
    data_parallel_rank: int | None = None


def _structs(array_like: bool) -> Any:
    if array_like:
        return StoredArray, RemovedArray, ClearedArray, msgspec.msgpack.Decoder(BatchArray)
    return StoredMap, RemovedMap, ClearedMap, msgspec.msgpack.Decoder(BatchMap)


class Subscriber:
    """What an llm-d indexer does with the stream, plus vLLM-style gap recovery."""

    def __init__(self, ctx: zmq.Context, pub: str, replay: str, positional: bool, drop: range) -> None:
        self.stored, self.removed, self.cleared, self.decoder = _structs(positional)
        self.sub = ctx.socket(zmq.SUB)
        self.sub.connect(pub)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"kv@")
        self.replay_endpoint = replay
        self.ctx = ctx
        self.drop = drop  # seqs of one topic this subscriber "loses" on purpose
        self.dropped_topic: str | None = None
        self.blocks: dict[str, set[tuple[int, str]]] = {}
        self.next_seq: dict[str, int] = {}
        self.gaps = 0
        self.replayed = 0

    def apply(self, topic: str, payload: bytes) -> None:
        batch = self.decoder.decode(payload)
        held = self.blocks.setdefault(topic, set())
        for event in batch.events:
            if isinstance(event, self.stored):
                assert len(event.token_ids) == event.block_size * len(event.block_hashes)
                held.update((h, event.medium) for h in event.block_hashes)
            elif isinstance(event, self.removed):
                held.difference_update((h, event.medium) for h in event.block_hashes)
            else:
                held.clear()

    def receive(self, frames: list[bytes]) -> None:
        assert len(frames) == 3
        topic, seq = frames[0].decode(), int.from_bytes(frames[1], "big")
        if self.dropped_topic is None:
            self.dropped_topic = topic
        if topic == self.dropped_topic and seq in self.drop:
            return
        expected = self.next_seq.get(topic, 0)
        if seq < expected:
            return  # a duplicate (an exporter restarted from its last saved state)
        if seq > expected:
            self.gaps += 1
            self.recover(topic, expected, seq)
        self.apply(topic, frames[2])
        self.next_seq[topic] = seq + 1

    def recover(self, topic: str, start: int, until: int) -> None:
        dealer = self.ctx.socket(zmq.DEALER)
        dealer.connect(self.replay_endpoint)
        try:
            dealer.send_multipart([b"", start.to_bytes(8, "big"), topic.encode()])
            while True:
                assert dealer.poll(30_000), "no replay answer"
                empty, rtopic, rseq, payload = dealer.recv_multipart()
                seq = int.from_bytes(rseq, "big")
                if seq == END:
                    assert payload == b""
                    break
                assert empty == b"" and rtopic.decode() == topic
                if start <= seq < until and seq == self.next_seq.get(topic, start):
                    self.apply(topic, payload)
                    self.next_seq[topic] = seq + 1
                    self.replayed += 1
        finally:
            dealer.close(linger=0)
        assert self.next_seq.get(topic, 0) == until, f"replay did not close the gap {start}..{until - 1}"

    def reconnect(self) -> None:
        """Lose whatever is queued (the subscriber was down) and subscribe again."""
        endpoint = self.sub.getsockopt_string(zmq.LAST_ENDPOINT)
        self.sub.close(linger=0)
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.connect(endpoint)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"kv@")

    def drain(self, quiet_ms: int = 700) -> None:
        while self.sub.poll(quiet_ms):
            self.receive(self.sub.recv_multipart())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _index_blocks(bootstrap: str, topic: str, model: str) -> dict[str, set[tuple[int, str]]]:
    index = CacheIndex()
    with EventReader(bootstrap, topic) as reader:
        reader.apply_to(index)
    assert not index.degraded_workers()
    out: dict[str, set[tuple[int, str]]] = {}
    for key in index.workers():
        held = out.setdefault(stream_topic("kv@{pod}@{model}", WorkerKey(*key), model), set())
        for window in index.worker_stats(key).windows:
            held.update(
                (b.block_hash, medium_for_level(b.cache_level)) for b in index.worker_blocks(key, window)
            )
    return out


@pytest.mark.parametrize("positional", [True, False], ids=["positional", "tagged-map"])
def test_llmd_style_subscriber_rebuilds_the_index_through_a_gap_and_a_restart(
    kafka_bootstrap: str, kafka_topic: str, tmp_path: Path, positional: bool
) -> None:
    produced = simulate_to_topic(kafka_bootstrap, kafka_topic, iterations=120)
    total = len(produced.sent)
    pub, replay = f"tcp://127.0.0.1:{_free_port()}", f"tcp://127.0.0.1:{_free_port()}"
    config = ZmqExportConfig(
        kafka_bootstrap,
        kafka_topic,
        pub=Endpoint(pub),
        replay=Endpoint(replay),
        model="m",
        positional=positional,
        state_path=tmp_path / "export.state",
    )
    ctx = zmq.Context()
    subscriber = Subscriber(ctx, pub, replay, positional, drop=range(2, 5))
    try:
        # first exporter: a third of the topic (with the forced gap), then another third that the
        # subscriber misses (it is down), then the exporter stops and saves its state
        with ZmqExporter(config, context=ctx) as first:
            subscriber.drain(300)  # let the subscription reach the PUB (a slow joiner is a gap too)
            first.run(max_messages=total // 3)
            subscriber.drain()
            assert first.stats.replays >= 1  # the forced gap
            first.run(max_messages=total // 3)
            first_seqs = dict(first.seqs)
        subscriber.reconnect()
        # second exporter: resumes from the state file, seqs continue; the subscriber's gap spans
        # the restart and is recovered from Kafka
        with ZmqExporter(config, context=ctx) as second:
            assert second.seqs == first_seqs
            done = threading.Event()

            def work() -> None:
                subscriber.drain(300)
                second.run(until_caught_up=True)
                done.set()

            thread = threading.Thread(target=work)
            thread.start()
            thread.join()
            subscriber.drain()
            final_seqs = dict(second.seqs)
            assert second.stats.replays >= 1
    finally:
        subscriber.sub.close(linger=0)
        ctx.term()

    assert subscriber.gaps >= 2 and subscriber.replayed >= 3  # the forced gap, recovered by replay
    # every stream complete, seq 0.. without a hole (all on the shared publisher, 0)
    assert {f"0:{topic}": seq for topic, seq in subscriber.next_seq.items()} == final_seqs
    expected = _index_blocks(kafka_bootstrap, kafka_topic, "m")
    assert set(expected) == {f"kv@{pod}@m" for pod in ("sim-a", "sim-a-dp1", "sim-b", "sim-b-dp1")}
    assert any(medium == "CPU" for held in expected.values() for _, medium in held), "no tier move exercised"
    for topic, held in expected.items():
        assert subscriber.blocks.get(topic, set()) == held, topic


def test_per_worker_publishers_and_the_older_two_frame_replay(kafka_bootstrap: str, kafka_topic: str) -> None:
    """vLLM's layout: one PUB (and replay ROUTER) per rank; a worker without one is skipped and
    counted; the replay answers in the older 2-frame form and ends with seq 2**64-1."""
    simulate_to_topic(kafka_bootstrap, kafka_topic, instances=("sim-a",), ranks=2, iterations=40)
    endpoints = {
        rank: (f"tcp://127.0.0.1:{_free_port()}", f"tcp://127.0.0.1:{_free_port()}") for rank in (0,)
    }
    config = ZmqExportConfig(
        kafka_bootstrap,
        kafka_topic,
        workers={WorkerKey("sim-a", 0): (Endpoint(endpoints[0][0]), Endpoint(endpoints[0][1]))},
        topic_template="",  # vLLM's default: an empty topic per rank
        replay_frames=2,
        checkpoint_interval_s=0.0,  # a replay anchor after every message (16 kept)
        replay_anchors=16,
    )
    ctx = zmq.Context()
    try:
        with ZmqExporter(config, context=ctx) as exporter:
            stats = exporter.run(until_caught_up=True)
            assert stats.unrouted_batches > 0  # rank 1 has no publisher
            published = exporter.seqs["1:"]  # publisher 1: the first --worker one
            assert len(exporter.anchors) == 16
            dealer = ctx.socket(zmq.DEALER)
            dealer.connect(endpoints[0][1])

            def replay(start: int) -> list[tuple[int, bytes]]:
                dealer.send_multipart([b"", start.to_bytes(8, "big")])
                got = []
                while True:
                    assert dealer.poll(30_000)
                    frames = dealer.recv_multipart()
                    assert len(frames) == 3 and frames[0] == b""
                    seq = int.from_bytes(frames[1], "big")
                    if seq == END:
                        assert frames[2] == b""
                        return got
                    assert msgspec.msgpack.decode(frames[2])[1]
                    got.append((seq, frames[2]))

            early, recent = replay(3), replay(published - 4)  # the oldest anchor, then a recent one
            dealer.close(linger=0)
            seqs = [seq for seq, _ in early]
            assert recent == early[-4:]  # the same batches, byte for byte, from a later anchor
            # a malformed request is ignored, the server keeps answering
            bad = ctx.socket(zmq.DEALER)
            bad.connect(endpoints[0][1])
            bad.send_multipart([b"", b"\x01"])
            bad.send_multipart([b"", (published - 1).to_bytes(8, "big")])
            assert bad.poll(30_000)
            assert int.from_bytes(bad.recv_multipart()[1], "big") == published - 1
            bad.close(linger=0)
    finally:
        ctx.term()
    assert seqs == list(range(3, published))


def test_a_worker_that_lost_events_is_cleared_then_refilled_by_its_snapshot(
    kafka_bootstrap: str, kafka_topic: str
) -> None:
    """In-band drops reach the subscriber as AllBlocksCleared (its stale blocks go), and the
    producer's snapshot brings back exactly what the index holds once it is rebuilt."""
    from kafka_streams import produce
    from kvevents.schemas import (
        EventBatch,
        KVCacheCreatedData,
        KVCacheEvent,
        KVCacheStoredBlockData,
        KVCacheStoredData,
        RankDrops,
    )

    def stored(eid: int, parent: int | None, *hashes: int) -> KVCacheEvent:
        return KVCacheEvent(
            eid, KVCacheStoredData(parent, [KVCacheStoredBlockData(h, [h] * 4) for h in hashes]), 64
        )

    def batch(seq: int, events: list[KVCacheEvent], dropped: int = 0) -> EventBatch:
        drops = [RankDrops(0, dropped)] if dropped else []
        return EventBatch("eng", events, producer_id=3, sequence=seq, dropped=drops)

    produce(
        kafka_bootstrap,
        kafka_topic,
        [
            batch(0, [KVCacheEvent(0, KVCacheCreatedData([100]), 64), stored(1, None, 1, 2, 3)]),
            batch(1, [stored(5, 3, 4)], dropped=3),  # events 2..4 were lost (say, removals of 2 and 3)
            batch(2, [KVCacheEvent(6, KVCacheCreatedData([100], snapshot=True), 64), stored(7, None, 1, 9)]),
        ],
    )
    port = _free_port()
    endpoint = f"tcp://127.0.0.1:{port}"
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.bind(endpoint)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    try:
        config = ZmqExportConfig(
            kafka_bootstrap, kafka_topic, pub=Endpoint(endpoint, bind=False), model="m", positional=False
        )
        with ZmqExporter(config, context=ctx) as exporter:
            assert not sub.poll(500)  # a SUB sends its subscription when it handles its socket's commands
            exporter.run(until_caught_up=True)
            assert exporter.converter.counters.clears_for_loss == 1
            received = []
            while sub.poll(1000):
                received.append(sub.recv_multipart())
    finally:
        sub.close(linger=0)
        ctx.term()
    events = [e for _, _, payload in received for e in msgspec.msgpack.decode(payload)[1]]
    kinds = [(e["type"], e.get("block_hashes")) for e in events]
    assert kinds == [
        ("AllBlocksCleared", None),
        ("BlockStored", [1, 2, 3]),
        ("AllBlocksCleared", None),  # the loss: blocks 2 and 3 may be gone, so all go
        ("BlockStored", [4]),
        ("AllBlocksCleared", None),  # the snapshot
        ("BlockStored", [1, 9]),
    ]
    assert _index_blocks(kafka_bootstrap, kafka_topic, "m") == {"kv@eng@m": {(1, "GPU"), (9, "GPU")}}


@contextlib.contextmanager
def _replaying(
    bootstrap: str, topic: str, tmp_path: Path, **overrides: Any
) -> Iterator[tuple[ZmqExporter, zmq.Context, str, int]]:
    """An exporter caught up with a one-worker topic of 2,500+ batches, answering replays on
    ipc:// sockets (small kernel buffers: a client that does not read fills the pipe after a
    few thousand batches, not tens of thousands): (exporter, context, replay endpoint, batches
    published)."""
    simulate_to_topic(bootstrap, topic, instances=("sim-a",), ranks=1, iterations=15000)
    replay = f"ipc://{tmp_path}/replay.sock"
    config = ZmqExportConfig(
        bootstrap,
        topic,
        pub=Endpoint(f"ipc://{tmp_path}/pub.sock"),
        replay=Endpoint(replay),
        replay_anchors=4,
        **overrides,
    )
    ctx = zmq.Context()
    try:
        with ZmqExporter(config, context=ctx) as exporter:
            exporter.run(until_caught_up=True)
            (published,) = exporter.seqs.values()
            assert published > 2500
            yield exporter, ctx, replay, published
    finally:
        ctx.destroy(linger=0)  # a failed assertion leaves sockets open: term() would wait on them


def _request(ctx: zmq.Context, endpoint: str, start: int) -> zmq.Socket:
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.RCVHWM, 1)
    dealer.connect(endpoint)
    dealer.send_multipart([b"", start.to_bytes(8, "big")])
    return dealer


def _answer_seqs(dealer: zmq.Socket) -> list[int]:
    """The seqs of one replay answer, read up to its end marker (10 s without a frame: fail)."""
    seqs = []
    while True:
        assert dealer.poll(10_000), "the answer stopped before its end marker"
        seq = int.from_bytes(dealer.recv_multipart()[2], "big")
        if seq == END:
            return seqs
        seqs.append(seq)


def _drained_without_end(dealer: zmq.Socket) -> bool:
    """Read what an abandoned answer left in the pipe: True if no end marker is among it."""
    while dealer.poll(200):
        if int.from_bytes(dealer.recv_multipart()[2], "big") == END:
            return False
    return True


def test_a_slow_replay_client_gets_every_batch_not_a_hole(
    kafka_bootstrap: str, kafka_topic: str, tmp_path: Path
) -> None:
    """A client that reads its answer late: the ROUTER waits for it instead of dropping what
    goes past its high-water mark (which, before, left a hole before a normal end marker)."""
    with _replaying(kafka_bootstrap, kafka_topic, tmp_path) as (exporter, ctx, replay, published):
        dealer = _request(ctx, replay, 0)
        time.sleep(2.0)  # the answer fills the pipe; the server waits
        assert _answer_seqs(dealer) == list(range(published))
        _wait_counted(exporter, 1)
        assert (exporter.stats.replays, exporter.stats.replays_abandoned) == (1, 0)


def test_a_client_that_stops_reading_is_abandoned_and_counted(
    kafka_bootstrap: str, kafka_topic: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A client that stops reading holds up no one: another's answer goes out meanwhile; the
    stuck one is abandoned after the timeout, counted, with no end marker."""
    monkeypatch.setattr(zmq_replay, "REPLAY_SEND_TIMEOUT_S", 5.0)
    with _replaying(kafka_bootstrap, kafka_topic, tmp_path) as (exporter, ctx, replay, published):
        stuck = _request(ctx, replay, 0)  # never read
        time.sleep(0.5)  # its answer is made and fills the pipe first
        fresh = _request(ctx, replay, published - 3)
        assert _answer_seqs(fresh) == [published - 3, published - 2, published - 1]
        _wait_counted(exporter, 1)
        assert (exporter.stats.replays, exporter.stats.replays_abandoned) == (1, 0)
        deadline = time.monotonic() + 30
        while exporter.stats.replays_abandoned == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert exporter.stats.replays_abandoned == 1
        assert 3 < exporter.stats.replayed_batches < published + 3
        assert _drained_without_end(stuck)  # what got out before it stopped, no end marker
        stuck.close(linger=0)  # held open until here: abandoned for not reading, not for leaving


def _wait_counted(exporter: ZmqExporter, replays: int) -> None:
    """The server counts an answer just after sending its end marker, so a client can read the
    marker first: wait for the count (under load the gap was enough to fail, CI-like run)."""
    _wait_for(lambda: exporter.stats.replays >= replays, f"{replays} answer(s) counted", timeout_s=10.0)


def _wait_for(check: Any, what: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def _count_replays(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """The arguments of every topic re-read a replay request causes, as they happen."""
    made: list[Any] = []
    real_replay = zmq_replay.ReplayServer.replay
    monkeypatch.setattr(
        zmq_replay.ReplayServer, "replay", lambda self, *a: made.append(a) or real_replay(self, *a)
    )
    return made


def test_a_flood_of_requests_from_one_client_costs_one_replay(
    kafka_bootstrap: str, kafka_topic: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A client that asks again and again while its answer is still going out (a retry loop,
    or hostile) is refused each time: counted, logged at powers of two, the topic re-read once;
    another client is answered meanwhile."""
    monkeypatch.setattr(zmq_replay, "REPLAY_SEND_TIMEOUT_S", 60.0)
    made = _count_replays(monkeypatch)
    with _replaying(kafka_bootstrap, kafka_topic, tmp_path) as (exporter, ctx, replay, published):
        flooder = _request(ctx, replay, 0)  # never read: its answer fills the pipe and waits
        _wait_for(lambda: len(made) == 1, "the first answer")
        for _ in range(200):
            flooder.send_multipart([b"", (0).to_bytes(8, "big")])
        _wait_for(lambda: exporter.stats.replays_refused == 200, "200 refusals")
        fresh = _request(ctx, replay, published - 2)
        assert _answer_seqs(fresh) == [published - 2, published - 1]
        assert len(made) == 2  # the flooder's first request and the fresh client's
        _wait_counted(exporter, 1)
        assert (exporter.stats.replays, exporter.stats.replays_abandoned) == (1, 0)
        flooder.close(linger=0)


def test_requests_past_the_pending_limit_are_refused_until_answers_finish(
    kafka_bootstrap: str, kafka_topic: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With ``replay_max_pending=2`` and two clients not reading, a third gets no answer (and
    costs no re-read); once the two are abandoned, a request is answered again."""
    monkeypatch.setattr(zmq_replay, "REPLAY_SEND_TIMEOUT_S", 3.0)
    made = _count_replays(monkeypatch)
    with _replaying(kafka_bootstrap, kafka_topic, tmp_path, replay_max_pending=2) as (
        exporter,
        ctx,
        replay,
        published,
    ):
        stuck = [_request(ctx, replay, 0), _request(ctx, replay, 0)]
        _wait_for(lambda: len(made) == 2, "both answers made")
        third = _request(ctx, replay, published - 1)
        _wait_for(lambda: exporter.stats.replays_refused == 1, "the third refused")
        assert not third.poll(500)  # no answer at all: not an empty one that would read as "nothing lost"
        _wait_for(lambda: exporter.stats.replays_abandoned == 2, "the stuck answers abandoned")
        again = _request(ctx, replay, published - 1)
        assert _answer_seqs(again) == [published - 1]
        _wait_counted(exporter, 1)
        assert (exporter.stats.replays, exporter.stats.replays_refused, len(made)) == (1, 1, 3)
        for sock in [*stuck, third, again]:
            sock.close(linger=0)


def test_invalid_requests_are_counted_and_logged_at_powers_of_two(
    kafka_bootstrap: str, kafka_topic: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with _replaying(kafka_bootstrap, kafka_topic, tmp_path) as (exporter, ctx, replay, published):
        dealer = ctx.socket(zmq.DEALER)
        dealer.connect(replay)
        with caplog.at_level("WARNING", logger=zmq_replay.log.name):
            for _ in range(20):
                dealer.send_multipart([b"", b"short"])
            _wait_for(lambda: exporter.stats.replay_requests_invalid == 20, "20 invalid requests")
            assert [
                r.getMessage().rsplit("(", 1)[1] for r in caplog.records if "invalid" in r.getMessage()
            ] == [f"{n} so far)" for n in (1, 2, 4, 8, 16)]
            dealer.send_multipart([b"", (published - 1).to_bytes(8, "big")])
            assert _answer_seqs(dealer) == [published - 1]
        dealer.close(linger=0)
