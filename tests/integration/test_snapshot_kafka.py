"""End to end through real Kafka: the simulator on the real manager loses events (its buffer
overflows), the worker is degraded in a live index, the engine publishes a snapshot, and the
index, fed by the EventReader, equals the engine's ground truth again; so does a fresh rebuild
of the whole topic."""

from __future__ import annotations

import pytest
from kafka_streams import producer as kafka_producer
from kvevents.consumer import CacheIndex, EventReader, WorkerKey
from kvevents.producer import KVCacheEventManager
from kvevents.producer.simulator import EngineSimulator, GroundTruth, SimulatorConfig
from kvevents.producer.simulator.workload import WorkloadConfig, WorkloadGenerator
from kvevents.schemas import EventBatch, encode_batch

pytestmark = pytest.mark.kafka

WORKLOAD = WorkloadConfig(
    seed=9,
    request_rate=60.0,
    system_prompt_tokens=(64, 256),
    document_tokens=(64, 384),
    num_documents=24,
    user_tokens=(8, 64),
    output_tokens=(4, 48),
    max_prompt_tokens=1200,
    follow_up_delay_s=0.1,
)
CONFIG = SimulatorConfig(
    instance_id="engine-a",
    attention_dp_rank=0,
    block_size=16,
    num_primary_blocks=160,
    num_secondary_blocks=48,
    window_sizes=(512, 2048),
)
WORKER = WorkerKey("engine-a", 0)


class MiniSink:
    """Drains the manager into numbered batches, drops in-band, produced keyed by instance."""

    def __init__(self, manager: KVCacheEventManager, bootstrap: str, topic: str) -> None:
        self.manager, self.topic = manager, topic
        self.producer = kafka_producer(bootstrap)
        self.sequence = 0

    def publish(self) -> None:
        assert self.manager.settle(timeout=30)
        drain = self.manager.drain(timeout=0)
        batch = EventBatch(
            CONFIG.instance_id, drain.events, producer_id=77, sequence=self.sequence, dropped=drain.dropped
        )
        self.sequence += 1
        self.producer.produce(self.topic, key=CONFIG.instance_id.encode(), value=encode_batch(batch))
        assert self.producer.flush(30) == 0


def assert_equals_truth(index: CacheIndex, truth: GroundTruth) -> None:
    for window, held in truth.windows.items():
        got = {b.block_hash: (b.cache_level, b.priority) for b in index.worker_blocks(WORKER, window)}
        assert got == {h: (b.cache_level, b.priority) for h, b in held.items()}


def follow(reader: EventReader, index: CacheIndex, sink: MiniSink) -> None:
    """Apply everything produced so far (a live tail that stops when it has it all)."""
    while sum(reader.offsets().values()) < sink.sequence:
        reader.apply_to(
            index,
            until_caught_up=False,
            max_messages=sink.sequence - sum(reader.offsets().values()),
            timeout=30,
        )


def test_a_snapshot_through_kafka_rebuilds_a_worker_degraded_by_drops(kafka_bootstrap, kafka_topic_factory):
    topic = kafka_topic_factory(partitions=2)
    index = CacheIndex()
    with (
        KVCacheEventManager(max_kv_event_entries=400, attention_dp_rank=0, attention_dp_size=1) as manager,
        EventReader(kafka_bootstrap, topic) as reader,
    ):
        sim = EngineSimulator(CONFIG, manager, WorkloadGenerator(WORKLOAD))
        sink = MiniSink(manager, kafka_bootstrap, topic)
        for _ in range(20):
            sim.step()
            sink.publish()
        follow(reader, index, sink)
        assert not index.is_degraded(WORKER)
        assert_equals_truth(index, sim.ground_truth())

        sim.run(max_iterations=120)  # the sink stalls: the manager drops the oldest events
        sink.publish()
        follow(reader, index, sink)
        assert manager.snapshot_requested and index.is_degraded(WORKER)

        sim.publish_snapshot()
        sim.step()  # the snapshot goes out with this iteration's flush, then the iteration's events
        sink.publish()
        follow(reader, index, sink)
        assert not index.is_degraded(WORKER)
        assert_equals_truth(index, sim.ground_truth())
        assert index.stats().counters["resyncs"] == 1
        truth = sim.ground_truth()

    with EventReader(kafka_bootstrap, topic) as rebuild:  # a router starting now
        fresh = CacheIndex()
        rebuild.apply_to(fresh)
    assert fresh.same_state(index) and not fresh.is_degraded(WORKER)
    assert_equals_truth(fresh, truth)


class HeldFlushes:
    """The manager, but ``flush`` does nothing while ``holding``: the engine's next real flush
    then hands the worker one iteration of more events than the buffer holds (a burst)."""

    def __init__(self, manager: KVCacheEventManager) -> None:
        self.manager = manager
        self.holding = False

    def flush(self) -> None:
        if not self.holding:
            self.manager.flush()

    def __getattr__(self, name: str) -> object:  # enqueue_*, enqueue_snapshot, snapshot_requested
        return getattr(self.manager, name)


def test_a_snapshot_through_the_kafka_sink_rebuilds_a_worker_degraded_by_drops(kafka_bootstrap, kafka_topic):
    from kvevents.producer import KafkaEventSink

    config = SimulatorConfig(**{**CONFIG.__dict__, "instance_id": "engine-s", "attention_dp_rank": None})
    worker = WorkerKey("engine-s", 0)
    index = CacheIndex()
    manager = KVCacheEventManager(max_kv_event_entries=300)
    sink = KafkaEventSink(manager, kafka_topic, "engine-s", config={"bootstrap.servers": kafka_bootstrap})
    engine = HeldFlushes(manager)
    sim = EngineSimulator(config, engine, WorkloadGenerator(WORKLOAD))

    def delivered() -> None:
        assert manager.settle(timeout=30) and sink.wait_delivered(timeout=60)
        target = sink.stats().messages_delivered_total
        while sum(reader.offsets().values()) < target:
            reader.apply_to(
                index, until_caught_up=False, max_messages=target - sum(reader.offsets().values()), timeout=30
            )

    def equals_truth() -> None:
        truth = sim.ground_truth()
        for window, held in truth.windows.items():
            got = {b.block_hash: (b.cache_level, b.priority) for b in index.worker_blocks(worker, window)}
            assert got == {h: (b.cache_level, b.priority) for h, b in held.items()}

    try:
        with EventReader(kafka_bootstrap, kafka_topic) as reader:
            for _ in range(20):
                sim.step()
            delivered()
            assert not index.is_degraded(worker)
            equals_truth()

            engine.holding = True  # one long iteration: far more events than the buffer holds
            sim.run(max_iterations=80)
            engine.holding = False
            manager.flush()
            delivered()
            assert manager.snapshot_requested and manager.stats().events_dropped_total > 0
            assert index.is_degraded(worker)
            assert "events dropped" in index.worker_stats(worker).degraded_reasons[0]

            sim.publish_snapshot()
            sim.step()
            delivered()
            assert not index.is_degraded(worker) and not manager.snapshot_requested
            equals_truth()
            assert index.stats().counters["resyncs"] == 1
    finally:
        manager.close()
        report = sink.close(60)
    assert report.clean, report
