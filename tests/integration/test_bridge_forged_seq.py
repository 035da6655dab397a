"""The live bridge against a publisher that forges its seq numbers (real ZMQ sockets on
loopback, no broker): a jump to 2**64 - 1 is counted as lost batches, not walked one by one,
and the bridge goes on reading."""

from __future__ import annotations

import socket
import threading
import time
from typing import Any

import pytest
import zmq  # the bridge extra is in dev
from bridge_engines import encode, engine_structs
from kvevents.producer.bridge.live import ZmqBridge
from kvevents.producer.bridge.replay import END_SEQ
from kvevents.schemas import EventBatch, KVCacheCreatedData, KVCacheRemovedData, decode_batch, encode_batch

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
    hold (the worker stopped on OverflowError). The loss reported in-band is capped to what an
    Avro long holds."""
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
        assert [(d.attention_dp_rank, d.dropped_events) for d in dropped] == [(0, min(lost, 2**63 - 1))]
        carried = EventBatch("engine", [], dropped=dropped)
        assert decode_batch(encode_batch(carried)).dropped == dropped, "the report fits the schema"

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
