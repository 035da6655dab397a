"""The live bridge against a publisher that forges its seq numbers (real ZMQ sockets on
loopback): a jump to 2**64 - 1 is counted as lost batches, not walked one by one, the bridge
goes on reading, and the sink reports that loss over as many batches as an Avro long needs."""

from __future__ import annotations

import socket
import threading
import time
from typing import Any

import pytest
import zmq  # the bridge extra is in dev
from bridge_engines import encode, engine_structs
from kvevents.consumer import CacheIndex, EventReader, WorkerKey
from kvevents.producer import KafkaEventSink
from kvevents.producer.bridge.live import ZmqBridge
from kvevents.producer.bridge.replay import END_SEQ
from kvevents.schemas import KVCacheCreatedData, KVCacheRemovedData
from sink_helpers import batches_of, consume, dropped_by_rank

V = engine_structs("vllm")


def _removed(*hashes: int) -> bytes:
    return bytes(encode(V["Batch"](1.0, [V["BlockRemoved"](list(hashes), "GPU")])))


def _endpoint() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


def _serve_nothing(ctx: Any, endpoint: str, stop: threading.Event, asked: list[int]) -> None:
    """A replay ROUTER holding no batch: each request gets the end marker alone."""
    router = ctx.socket(zmq.ROUTER)
    router.bind(endpoint)
    try:
        while not stop.is_set():
            if router.poll(50):
                client, _, start = router.recv_multipart()
                asked.append(int.from_bytes(start, "big"))
                router.send_multipart([client, b"", END_SEQ.to_bytes(8, "big"), b""])
    finally:
        router.close(0)


def _drain_until(bridge: ZmqBridge, events: list[Any], dropped: list[Any], n_events: int) -> None:
    deadline = time.monotonic() + 10
    while (len(events) < n_events or not dropped) and time.monotonic() < deadline:
        drain = bridge.drain(0.1)
        events += drain.events
        dropped += drain.dropped


@pytest.mark.parametrize("replay", [False, True], ids=["no replay", "replay"])
@pytest.mark.parametrize("jump_to", [END_SEQ, 10**12])
def test_a_forged_seq_jump_is_one_counted_loss_and_the_bridge_goes_on(replay: bool, jump_to: int) -> None:
    """Before, the worker walked the gap seq by seq (2**64 steps: it never came back, and kept a
    core busy), and with replay its next idle probe asked for seq 2**64, which 8 bytes cannot
    hold (the worker stopped on OverflowError)."""
    ctx = zmq.Context()
    endpoint, replay_endpoint = _endpoint(), _endpoint()
    stop, asked = threading.Event(), list[int]()
    server = threading.Thread(target=_serve_nothing, args=(ctx, replay_endpoint, stop, asked), daemon=True)
    if replay:
        server.start()
    pub = ctx.socket(zmq.XPUB)  # an XPUB sees the bridge's subscription arrive: no sleep
    pub.bind(endpoint)
    bridge = ZmqBridge(
        "vllm", endpoint, replay_endpoint=replay_endpoint if replay else None,
        checkpoint_interval=3600, idle_probe=0.05, replay_timeout=0.5, ctx=ctx,
    )  # fmt: skip
    try:
        assert pub.poll(5000), "the bridge subscribed"
        pub.recv()
        for seq, payload in ((0, _removed(1)), (jump_to, _removed(2))):
            pub.send_multipart([b"kv", seq.to_bytes(8, "big"), payload])
        events: list[Any] = []
        dropped: list[Any] = []
        _drain_until(bridge, events, dropped, 2)
        assert [e.data for e in events] == [KVCacheRemovedData([1]), KVCacheRemovedData([2])]
        lost = jump_to - 1
        assert bridge.counts["batches_lost"] == lost and bridge.last_seq[0] == jump_to
        assert [(d.attention_dp_rank, d.dropped_events) for d in dropped] == [(0, lost)]

        time.sleep(0.3)  # idle: with replay, the bridge probes for what follows the jump
        pub.send_multipart([b"kv", (5).to_bytes(8, "big"), _removed(3)])  # seq back: a restart
        later: list[Any] = []
        deadline = time.monotonic() + 10
        while len(later) < 2 and time.monotonic() < deadline:
            later += bridge.drain(0.1).events
        assert [type(e.data) for e in later] == [KVCacheCreatedData, KVCacheRemovedData]
        assert bridge.counts["worker_errors"] == 0
        if replay:
            assert asked and max(asked) < END_SEQ, "never a seq past 8 bytes"
    finally:
        bridge.close()
        stop.set()
        if replay:
            server.join(5)
        pub.close(0)
        ctx.term()


def test_a_loss_past_an_avro_long_reaches_kafka_over_several_batches(
    kafka_bootstrap: str, kafka_topic: str
) -> None:
    """A loss of 2**64 - 2 batches cannot ride in one batch's ``dropped`` (an Avro long): before,
    framing every later message failed on it, so every later event was lost as unencodable. The
    sink carries 2**63 - 1 per batch and the rest in the next, and the events go through."""
    ctx = zmq.Context()
    endpoint = _endpoint()
    pub = ctx.socket(zmq.XPUB)
    pub.bind(endpoint)
    bridge = ZmqBridge("vllm", endpoint, checkpoint_interval=3600, ctx=ctx)
    sink = KafkaEventSink(
        bridge,
        kafka_topic,
        "forged",
        config={"bootstrap.servers": kafka_bootstrap},
        on_delivery=bridge.on_delivery,
    )
    try:
        assert pub.poll(5000), "the bridge subscribed"
        pub.recv()
        for seq, payload in ((0, _removed(1)), (END_SEQ, _removed(2)), (3, _removed(4))):
            pub.send_multipart([b"kv", seq.to_bytes(8, "big"), payload])
        deadline = time.monotonic() + 30
        while bridge.counts["batches"] < 3 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert sink.wait_delivered(30)
    finally:
        bridge.close()
        report = sink.close(30)
        pub.close(0)
        ctx.term()
    assert report.clean and sink.stats().events_lost_by_reason["unencodable"] == 0
    batches = batches_of(consume(kafka_bootstrap, kafka_topic), "forged")
    assert all(d.dropped_events <= 2**63 - 1 for b in batches for d in b.dropped)
    assert dropped_by_rank(batches) == {0: (END_SEQ - 1) + 3}, (
        "the jump's gap, then seqs 0-2 after the restart"
    )
    events = [e.data for b in batches for e in b.events]
    assert events == [
        KVCacheRemovedData([1]), KVCacheRemovedData([2]), KVCacheCreatedData([]), KVCacheRemovedData([4])
    ]  # fmt: skip
    index = CacheIndex()
    with EventReader(kafka_bootstrap, kafka_topic) as reader:
        reader.apply_to(index)
    assert WorkerKey("forged", 0) in index.degraded_workers()
