"""The pre-encoded path on a real broker, against the object path.

- The sink: the same drains (events of two ranks, drops, Stored events over the message limit)
  handed once as objects and once as pre-encoded bytes put the same messages on two topics: the
  events after each envelope byte for byte, the envelopes equal but for the random producer id
  and the creation time (and their lengths).
- The bridge: one engine (real PUB and replay ROUTER, tier moves, gaps filled by replay) feeding
  three bridges at once: pre-encoded by the compiled converter, objects, and pre-encoded without
  the compiled converter (the pure fallback: Python events encoded one by one). The topics hold
  the same events (decode-identical: how the events fall into messages depends on thread
  timing, so message bytes are not compared).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import msgspec
import zmq
from bridge_engines import FakeEnginePublisher, TrueCacheEngine, wait_for
from kvevents.producer import KafkaEventSink
from kvevents.producer.bridge.live import ZmqBridge
from kvevents.producer.buffer import EventDrain
from kvevents.producer.sink_encoded import EncodedDrain, EncodedEvents
from kvevents.schemas import EventBatch, KVCacheEvent, RankDrops, decode_batch, encode_batch
from kvevents.schemas.codec import envelope_of
from sink_helpers import huge_stored_event, rank_events, reassemble
from test_bridge_live import free_ports


class ListSource:
    """Hands out the given drains one per call, as objects."""

    def __init__(self, drains: list[EventDrain]) -> None:
        self._drains = list(drains)

    @property
    def attention_dp_size(self) -> int:
        return 2

    @property
    def closed(self) -> bool:
        return not self._drains

    def drain(self, timeout: float | None = None) -> EventDrain:
        if not self._drains:
            return EventDrain([], [])
        return self._drains.pop(0)


class EncodedListSource(ListSource):
    """The same, pre-encoded."""

    def drain_encoded(self, timeout: float | None = None) -> EncodedDrain:
        drain = self.drain(timeout)
        return EncodedDrain(EncodedEvents.of(drain.events), drain.dropped)


def raw_messages(bootstrap: str, topic: str, count: int) -> list[bytes]:
    from confluent_kafka import OFFSET_BEGINNING, Consumer, TopicPartition

    consumer = Consumer(
        {"bootstrap.servers": bootstrap, "group.id": f"g-{topic}", "enable.auto.commit": False}
    )
    consumer.assign([TopicPartition(topic, 0, OFFSET_BEGINNING)])
    out: list[bytes] = []
    deadline = time.monotonic() + 60
    try:
        while len(out) < count and time.monotonic() < deadline:
            for message in consumer.consume(100, 0.5):
                assert message.error() is None, message.error()
                out.append(message.value())
    finally:
        consumer.close()
    return out


def split_message(value: bytes) -> tuple[EventBatch, bytes]:
    """The envelope (producer id and time zeroed) and the events' bytes after it."""
    batch = decode_batch(value)
    prefix = envelope_of(encode_batch(msgspec.structs.replace(batch, events=[])))
    assert value.startswith(prefix)
    return msgspec.structs.replace(batch, events=[], producer_id=0, created_at_us=0), value[len(prefix) :]


def test_sink_puts_the_same_bytes_on_the_topic(
    kafka_bootstrap: str, kafka_topic_factory: Callable[..., str]
) -> None:
    ranks = [rank_events(0, 300, seed=1), rank_events(1, 300, seed=2)]
    drains = []
    for k in range(6):
        events: list[KVCacheEvent] = ranks[0][k * 50 : (k + 1) * 50] + ranks[1][k * 50 : (k + 1) * 50]
        if k == 2:
            events.append(huge_stored_event(10_000, 300, 16, rank=1))  # over the message limit: split
        dropped = [RankDrops(1, 3)] if k == 4 else []
        drains.append(EventDrain(events, dropped))
    values = []
    for encoded in (False, True):
        topic = kafka_topic_factory()
        sink = KafkaEventSink(
            EncodedListSource(drains) if encoded else ListSource(drains),
            topic,
            "engine-x",
            config={"bootstrap.servers": kafka_bootstrap, "message.max.bytes": 6000},
            topic_config_timeout=0,
            max_events_per_message=40,
        )
        assert sink.wait_delivered(30)
        report = sink.close(30)
        stats = sink.stats()
        assert report.clean and stats.events_split_total == 1 and stats.fragments_total > 2
        values.append(raw_messages(kafka_bootstrap, topic, stats.messages_produced_total))
    objects, spliced = values
    assert len(objects) == len(spliced) > 10
    assert [split_message(v) for v in objects] == [split_message(v) for v in spliced]
    batches = [decode_batch(v) for v in spliced]
    assert sum(d.dropped_events for b in batches for d in b.dropped) == 3
    assert reassemble(batches) == [e for d in drains for e in d.events]


def test_bridges_with_and_without_preencoding_agree(
    kafka_bootstrap: str, kafka_topic_factory: Callable[..., str]
) -> None:
    ctx = zmq.Context()
    pub, replay = free_ports(1), free_ports(1)
    publisher = FakeEnginePublisher(ctx, f"tcp://127.0.0.1:{pub}", f"tcp://127.0.0.1:{replay}")
    engine = TrueCacheEngine("vllm", 0, seed=7)
    modes = {"compiled": (True, True), "objects": (False, True), "pure": (True, False)}
    topics = {mode: kafka_topic_factory() for mode in modes}
    rigs: dict[str, tuple[ZmqBridge, KafkaEventSink]] = {}
    try:
        for mode, topic in topics.items():
            bridge = ZmqBridge(
                "vllm",
                f"tcp://127.0.0.1:{pub}",
                replay_endpoint=f"tcp://127.0.0.1:{replay}",
                ctx=ctx,
                preencoded=modes[mode][0],
            )
            bridge.converters[0].compiled = modes[mode][1]
            sink = KafkaEventSink(
                bridge,
                topic,
                "engine-y",
                config={"bootstrap.servers": kafka_bootstrap},
                on_delivery=bridge.on_delivery,
            )
            bridge.watch(sink)
            rigs[mode] = (bridge, sink)
        time.sleep(0.4)  # the SUBs connect
        for step in range(150):
            publisher.send(engine.batch(), publish=step % 11 != 5)  # some only in the replay buffer
        publisher.send(engine.batch())
        for bridge, sink in rigs.values():
            assert wait_for(lambda b=bridge: b.last_seq[0] == publisher.seq - 1, 30)
            assert sink.wait_delivered(30)
        streams: dict[str, Any] = {}
        for mode, (bridge, sink) in rigs.items():
            assert bridge.counts["replays"] > 0
            assert bridge.counts["batches_lost"] == 0
            produced = sink.stats().messages_produced_total
            batches = sorted((decode_batch(v) for v in raw_messages(kafka_bootstrap, topics[mode], produced)),
                             key=lambda b: b.sequence)  # fmt: skip
            streams[mode] = reassemble(batches)
        assert streams["compiled"] == streams["objects"] == streams["pure"]
        assert len(streams["compiled"]) > 150
        updated = [e for e in streams["compiled"] if type(e.data).__name__ == "KVCacheUpdatedData"]
        assert updated  # tier moves went through
        assert rigs["compiled"][0].converters[0].compiled_payloads > 0
        assert rigs["pure"][0].converters[0].compiled_payloads == 0
    finally:
        for bridge, sink in rigs.values():
            bridge.close()
            sink.close(10)
        publisher.close()
        ctx.term()
