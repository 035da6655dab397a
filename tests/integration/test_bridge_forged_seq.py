"""The live bridge against a publisher that forges its seq numbers (real ZMQ sockets on
loopback, no broker): a jump to 2**64 - 1 is counted as lost batches, not walked one by one."""

from __future__ import annotations

import socket
import time

import pytest
import zmq  # the bridge extra is in dev
from bridge_engines import encode, engine_structs
from kvevents.producer.bridge.live import ZmqBridge
from kvevents.schemas import EventBatch, KVCacheRemovedData, decode_batch, encode_batch

V = engine_structs("vllm")


def _removed(*hashes: int) -> bytes:
    return encode(V["Batch"](1.0, [V["BlockRemoved"](list(hashes), "GPU")]))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.parametrize("jump_to", [2**64 - 1, 10**12])
def test_a_forged_seq_jump_is_one_counted_loss_and_the_bridge_goes_on(jump_to: int) -> None:
    """Before, the worker walked the gap seq by seq (2**64 steps: it never came back, and its
    CPU stayed busy); the loss it reports in-band is capped to what an Avro long holds."""
    ctx = zmq.Context()
    endpoint = f"tcp://127.0.0.1:{_free_port()}"
    pub = ctx.socket(zmq.XPUB)  # an XPUB sees the bridge's subscription arrive: no sleep
    pub.bind(endpoint)
    bridge = ZmqBridge("vllm", endpoint, checkpoint_interval=3600, ctx=ctx)
    try:
        assert pub.poll(5000), "the bridge subscribed"
        pub.recv()
        for seq, payload in ((0, _removed(1)), (jump_to, _removed(2))):
            pub.send_multipart([b"kv", seq.to_bytes(8, "big"), payload])
        deadline = time.monotonic() + 10
        events, dropped = [], []
        while (len(events) < 2 or not dropped) and time.monotonic() < deadline:
            drain = bridge.drain(0.2)
            events += drain.events
            dropped += drain.dropped
        assert [e.data for e in events] == [KVCacheRemovedData([1]), KVCacheRemovedData([2])]
        lost = jump_to - 1
        assert bridge.counts["batches_lost"] == lost and bridge.last_seq[0] == jump_to
        assert [(d.attention_dp_rank, d.dropped_events) for d in dropped] == [(0, min(lost, 2**63 - 1))]
        carried = EventBatch("engine", [], dropped=dropped)
        assert decode_batch(encode_batch(carried)).dropped == dropped, "the report fits the schema"
    finally:
        bridge.close()
        pub.close(0)
        ctx.term()
