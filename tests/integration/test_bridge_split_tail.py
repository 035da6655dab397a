"""A bridge killed while the sink was sending the fragments of a split Stored event: the topic
holds only the first fragments. The restarted bridge reads how many blocks of its last event the
topic holds (real broker), and when the engine's replay regenerates that event with more, the
missing tail is reported in-band as lost (a new producer session cannot continue a split event),
instead of being skipped with the rest of the event."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import zmq
from bridge_engines import FakeEnginePublisher, encode, engine_structs, wait_for
from confluent_kafka import Producer
from kvevents.producer.bridge import ZmqEventConverter
from kvevents.producer.bridge.kafka_tail import TailEvent, last_events
from kvevents.producer.bridge.live import ZmqBridge
from kvevents.producer.bridge.state import save_state
from kvevents.producer.sink_stats import DeliveryReport
from kvevents.schemas import (
    EventBatch,
    KVCacheEvent,
    KVCacheRemovedData,
    KVCacheStoredBlockData,
    KVCacheStoredData,
    RankDrops,
    encode_batch,
)
from test_bridge_live import INSTANCE, free_ports


def _block(h: int) -> KVCacheStoredBlockData:
    return KVCacheStoredBlockData(h, [h, h])


def _produce(bootstrap: str, topic: str, batches: list[EventBatch]) -> None:
    producer = Producer({"bootstrap.servers": bootstrap})
    for batch in batches:
        producer.produce(topic, key=batch.instance_id.encode(), value=encode_batch(batch))
    assert producer.flush(10) == 0


def test_tail_counts_the_blocks_of_a_split_event(
    kafka_bootstrap: str, kafka_topic_factory: Callable[..., str]
) -> None:
    whole = KVCacheEvent(0, KVCacheStoredData(None, [_block(1), _block(2)]), 0, 0)
    removed = KVCacheEvent(0, KVCacheRemovedData([9]), 0, 1)
    first = KVCacheEvent(1, KVCacheStoredData(2, [_block(3), _block(4), _block(5)]), 0, 0)
    second = KVCacheEvent(1, KVCacheStoredData(5, [_block(6)]), 0, 0)
    batches = [
        EventBatch(INSTANCE, [whole, removed], attention_dp_size=2, sequence=0),
        EventBatch(INSTANCE, [first], attention_dp_size=2, sequence=1),
        EventBatch(INSTANCE, [second], attention_dp_size=2, sequence=2, first_event_block_offset=3),
        EventBatch("another-instance", [KVCacheEvent(7, KVCacheRemovedData([1]), 0, 0)], sequence=0),
    ]
    complete, partial = kafka_topic_factory(), kafka_topic_factory()
    _produce(kafka_bootstrap, complete, batches)
    _produce(kafka_bootstrap, partial, batches[:2])
    assert last_events(kafka_bootstrap, complete, INSTANCE, ranks=2) == {
        0: TailEvent(1, 4),
        1: TailEvent(0, None),
    }
    assert last_events(kafka_bootstrap, partial, INSTANCE, ranks=2) == {
        0: TailEvent(1, 3),
        1: TailEvent(0, None),
    }


def _ack(bridge: ZmqBridge, last_ids: dict[int, int], dropped: list[RankDrops]) -> None:
    """What the sink reports once Kafka took a message (the bridge's checkpoints wait for it)."""
    bridge.on_delivery(
        DeliveryReport(
            sequence=0,
            events=1,
            events_by_rank=dict.fromkeys(last_ids, 1),
            last_event_id_by_rank=last_ids,
            dropped={d.attention_dp_rank: d.dropped_events for d in dropped},
            size_bytes=1,
            first_event_block_offset=0,
            produced_at=0.0,
            latency_s=0.0,
            acked_at=0.0,
            error=None,
            partition=0,
            offset=0,
        )
    )


@pytest.mark.parametrize(("blocks_in_kafka", "lost"), [(3, 1), (5, 0)])
def test_restart_reports_the_missing_tail_of_a_split_event(
    tmp_path: Path, blocks_in_kafka: int, lost: int
) -> None:
    s = engine_structs("vllm")
    ctx = zmq.Context()
    pub, replay = free_ports(1), free_ports(1)
    engine = FakeEnginePublisher(ctx, f"tcp://127.0.0.1:{pub}", f"tcp://127.0.0.1:{replay}")
    # sent while the bridge was down: event 0 (5 blocks, the one split) and event 1
    engine.send(encode(s["Batch"](1.0, [s["BlockStored"]([1, 2, 3, 4, 5], None, list(range(10)), 2, None, "GPU", None)])), publish=False)  # fmt: skip
    engine.send(encode(s["Batch"](2.0, [s["BlockRemoved"]([1], "GPU")])), publish=False)
    state = tmp_path / "bridge.state"
    save_state(state, "vllm", {0: {"last_seq": None, "converter": ZmqEventConverter("vllm").to_state()}})
    bridge = ZmqBridge(
        "vllm",
        f"tcp://127.0.0.1:{pub}",
        replay_endpoint=f"tcp://127.0.0.1:{replay}",
        state_path=state,
        in_kafka={0: 0},
        in_kafka_blocks={0: blocks_in_kafka},
        checkpoint_interval=3600,
        ctx=ctx,
    )
    events: list[KVCacheEvent] = []
    drops: list[RankDrops] = []

    def drained() -> bool:
        got = bridge.drain(0.05)
        events.extend(got.events)
        drops.extend(got.dropped)
        return bridge.last_seq[0] == 1 and not bridge.drain(0).events

    try:
        assert wait_for(drained, timeout=15)
        assert [e.event_id for e in events] == [1]  # event 0 is in Kafka (whole or not)
        assert sum(d.dropped_events for d in drops) == lost
        assert bridge.stats().get("split_tails_lost", 0) == lost
        _ack(bridge, {0: 1}, drops)
    finally:
        bridge.close()
        engine.close()
        ctx.term()


class _Sink:
    """The part of ``KafkaEventSink.stats()`` the bridge's checkpoints look at."""

    def __init__(self) -> None:
        self.queued_messages = 0
        self.in_flight_messages = 1  # a fragment still on its way

    def stats(self) -> _Sink:
        return self


def test_checkpoints_wait_until_the_sink_has_sent_everything(tmp_path: Path) -> None:
    s = engine_structs("vllm")
    ctx = zmq.Context()
    pub = free_ports(1)
    engine = FakeEnginePublisher(ctx, f"tcp://127.0.0.1:{pub}", None)
    state = tmp_path / "bridge.state"
    bridge = ZmqBridge("vllm", f"tcp://127.0.0.1:{pub}", state_path=state, checkpoint_interval=0.05, ctx=ctx)
    sink = _Sink()
    bridge.watch(sink)
    try:
        payload = encode(s["Batch"](1.0, [s["BlockStored"]([1, 2], None, [1, 2], 1, None, "GPU", None)]))
        assert wait_for(
            lambda: engine.send(payload) is not None and bridge.last_seq[0] is not None, timeout=10
        )
        # every send received (those before the SUB joined are reported lost), all drained
        assert wait_for(lambda: bridge.last_seq[0] == engine.seq - 1)
        drops: list[RankDrops] = []
        while True:
            got = bridge.drain(0.05)
            drops.extend(got.dropped)
            if not got.events and not got.dropped:
                break
        _ack(bridge, {0: bridge.converters[0].next_event_id[0] - 1}, drops)
        assert wait_for(lambda: bridge.counts["checkpoints_deferred"] >= 2)
        assert bridge.counts["checkpoints"] == 0 and not state.exists()  # acknowledged, not all sent
        sink.in_flight_messages = 0
        assert wait_for(lambda: bridge.counts["checkpoints"] >= 1)
        assert state.exists()
    finally:
        bridge.close()
        engine.close()
        ctx.term()
