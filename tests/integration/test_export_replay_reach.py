"""Replay reach of ``kvevents export zmq`` against a real broker and a real DEALER: a seq
published before an exporter restart, and older than the recent anchors, is answered from Kafka
byte for byte as it was published live; after retention deletes the start of the topic
(``delete_records``, what retention does to old segments), the anchors whose data went are
forgotten and a request for a deleted seq is answered from the oldest retained anchor."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
import zmq
from cli_streams import simulate_to_topic
from confluent_kafka import TopicPartition
from confluent_kafka.admin import AdminClient
from kvevents.consumer.export.zmq_export import Endpoint, ZmqExportConfig, ZmqExporter

pytestmark = pytest.mark.kafka

END = 0xFFFF_FFFF_FFFF_FFFF
STREAM = "0:kv@sim-a@m"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _drain(sub: zmq.Socket, live: dict[int, bytes], quiet_ms: int = 700) -> None:
    while sub.poll(quiet_ms):
        topic, seq, payload = sub.recv_multipart()
        assert topic == b"kv@sim-a@m"
        live[int.from_bytes(seq, "big")] = payload


def _replay(ctx: zmq.Context, endpoint: str, start: int) -> list[tuple[int, bytes]]:
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(endpoint)
    try:
        dealer.send_multipart([b"", start.to_bytes(8, "big")])
        got = []
        while True:
            assert dealer.poll(30_000), "no replay answer"
            empty, topic, seq_bytes, payload = dealer.recv_multipart()
            seq = int.from_bytes(seq_bytes, "big")
            if seq == END:
                assert payload == b""
                return got
            assert empty == b"" and topic == b"kv@sim-a@m"
            got.append((seq, payload))
    finally:
        dealer.close(linger=0)


def test_an_old_seq_is_answered_across_a_restart_and_after_retention(
    kafka_bootstrap: str, kafka_topic: str, tmp_path: Path
) -> None:
    produced = simulate_to_topic(kafka_bootstrap, kafka_topic, instances=("sim-a",), ranks=1, iterations=160)
    total = len(produced.sent)
    pub, replay = f"tcp://127.0.0.1:{_free_port()}", f"tcp://127.0.0.1:{_free_port()}"
    state = tmp_path / "export.state"
    config = ZmqExportConfig(
        kafka_bootstrap,
        kafka_topic,
        pub=Endpoint(pub),
        replay=Endpoint(replay),
        model="m",
        state_path=state,
        checkpoint_interval_s=0.0,  # an anchor per message, thinned to 6
        replay_anchors=6,
    )
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.connect(pub)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    live: dict[int, bytes] = {}
    try:
        with ZmqExporter(config, context=ctx) as first:
            _drain(sub, live, 300)
            first.run(max_messages=total // 2)
            _drain(sub, live)
            before_restart = first.seqs[STREAM]
        with ZmqExporter(config, context=ctx) as second:  # resumes: its own anchors + the first's
            assert len(second.anchors) == 6
            _drain(sub, live, 500)  # the SUB reconnects to the new PUB
            second.run(until_caught_up=True)
            _drain(sub, live)
            published = second.seqs[STREAM]
            assert sorted(live) == list(range(published)) and before_restart < published - 10
            assert len(list(Path(f"{state}.anchors").glob("anchor-*.bin"))) == 6

            # seq 1: published by the first exporter, older than every recent anchor
            assert _replay(ctx, replay, 1) == [(s, live[s]) for s in range(1, published)]

            # retention deletes the first third of the topic (and the anchors there)
            cut = total // 3
            admin = AdminClient({"bootstrap.servers": kafka_bootstrap})
            for future in admin.delete_records([TopicPartition(kafka_topic, 0, cut)]).values():
                future.result(timeout=30)
            answer = _replay(ctx, replay, 0)
            kept = second.anchors.positions()
            assert kept and all(position[0] >= cut for position in kept)  # the deleted ones forgotten
            assert len(list(Path(f"{state}.anchors").glob("anchor-*.bin"))) == len(kept)
            oldest = answer[0][0]
            assert 0 < oldest < published - 1
            assert answer == [(s, live[s]) for s in range(oldest, published)]  # from the oldest retained
            # a retained seq after it: exactly from there
            middle = (oldest + published) // 2
            assert _replay(ctx, replay, middle) == [(s, live[s]) for s in range(middle, published)]
    finally:
        sub.close(linger=0)
        ctx.term()
