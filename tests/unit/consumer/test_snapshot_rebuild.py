"""End to end in one process: the simulator on the real manager, drops, a snapshot, the index.

A worker whose events the manager dropped is degraded in the index; the snapshot the engine
publishes then rebuilds it to exactly the engine's ground truth (every block with its level
and priority), both for a reader that knows the snapshot flag and for one that does not.
Through real Kafka: ``tests/integration/test_snapshot_kafka.py``.
"""

from __future__ import annotations

import pytest
from kvevents.consumer import CacheIndex, WorkerKey
from kvevents.producer import KVCacheEventManager
from kvevents.producer.simulator import EngineSimulator, GroundTruth, SimulatorConfig
from kvevents.producer.simulator.workload import WorkloadConfig, WorkloadGenerator
from kvevents.schemas import EventBatch, KVCacheCreatedData, KVCacheEvent, encode_batch

WORKLOAD = WorkloadConfig(
    seed=5,
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
    instance_id="sim-7",
    block_size=16,
    num_primary_blocks=160,
    num_secondary_blocks=48,
    window_sizes=(512, 2048),
)
WORKER = WorkerKey("sim-7", 0)


class Pipeline:
    """Drains the manager into numbered batches (drops in-band) and applies them to indexes."""

    def __init__(self, manager: KVCacheEventManager, *indexes: CacheIndex) -> None:
        self.manager = manager
        self.indexes = indexes
        self.sequence = 0
        self.batches: list[EventBatch] = []

    def deliver(self) -> EventBatch:
        assert self.manager.settle(timeout=30)
        drain = self.manager.drain(timeout=0)
        batch = EventBatch(
            CONFIG.instance_id, drain.events, producer_id=3, sequence=self.sequence, dropped=drain.dropped
        )
        self.sequence += 1
        self.batches.append(batch)
        message = encode_batch(batch)
        for index in self.indexes:
            index.apply_encoded(message)
        return batch


def as_old_reader(batch: EventBatch) -> EventBatch:
    """What a reader of schema v1 sees: every snapshot flag at its default."""
    events = [
        KVCacheEvent(
            e.event_id,
            KVCacheCreatedData(e.data.num_blocks_per_cache_level),
            e.window_size,
            e.attention_dp_rank,
        )
        if isinstance(e.data, KVCacheCreatedData)
        else e
        for e in batch.events
    ]
    return EventBatch(
        batch.instance_id,
        events,
        producer_id=batch.producer_id,
        sequence=batch.sequence,
        dropped=batch.dropped,
    )


def assert_index_equals_truth(index: CacheIndex, truth: GroundTruth) -> None:
    stats = index.worker_stats(WORKER)
    assert sorted(stats.windows) == sorted(truth.windows)
    for window, held in truth.windows.items():
        got = {b.block_hash: (b.cache_level, b.priority) for b in index.worker_blocks(WORKER, window)}
        assert got == {h: (b.cache_level, b.priority) for h, b in held.items()}
        assert stats.windows[window].capacity == tuple(truth.num_blocks_per_cache_level[window])
        assert all(b.content_hash is not None for b in index.worker_blocks(WORKER, window))  # no orphans


@pytest.mark.parametrize("core", ["compiled", "python"])
def test_a_snapshot_rebuilds_a_worker_degraded_by_drops_to_the_ground_truth(core: str) -> None:
    index = CacheIndex(core=core)
    with KVCacheEventManager(max_kv_event_entries=400) as manager:
        sim = EngineSimulator(CONFIG, manager, WorkloadGenerator(WORKLOAD))
        pipe = Pipeline(manager, index)
        for _ in range(30):  # a healthy start: the index follows the engine exactly
            sim.step()
            pipe.deliver()
        assert not index.is_degraded(WORKER)
        assert_index_equals_truth(index, sim.ground_truth())

        sim.run(max_iterations=120)  # nobody drains: the buffer overflows and drops the oldest
        assert manager.settle(timeout=30)
        assert manager.snapshot_requested and manager.stats().events_dropped_total > 0
        lossy = pipe.deliver()
        assert sum(d.dropped_events for d in lossy.dropped) == manager.stats().events_dropped_total
        assert index.is_degraded(WORKER)
        assert "events dropped" in index.worker_stats(WORKER).degraded_reasons[0]

        summary = sim.publish_snapshot()  # between iterations; out with the next flush
        manager.flush()
        assert not manager.snapshot_requested
        assert summary.blocks == sum(len(w) for w in sim.ground_truth().windows.values())
        pipe.deliver()
        assert not index.is_degraded(WORKER)
        assert_index_equals_truth(index, sim.ground_truth())
        assert index.stats().counters["resyncs"] == 1
        for _ in range(40):  # and it keeps following the engine afterwards
            sim.step()
            pipe.deliver()
        assert_index_equals_truth(index, sim.ground_truth())
        assert not index.is_degraded(WORKER)

    old_reader = CacheIndex(core=core)
    for batch in pipe.batches:
        old_reader.apply(as_old_reader(batch))
    assert old_reader.same_state(index) and not old_reader.is_degraded(WORKER)


def test_the_simulator_answers_snapshot_requests_by_itself() -> None:
    index = CacheIndex()
    config = SimulatorConfig(**{**CONFIG.__dict__, "snapshot_on_request": True})
    with KVCacheEventManager(max_kv_event_entries=300) as manager:
        sim = EngineSimulator(config, manager, WorkloadGenerator(WORKLOAD))
        pipe = Pipeline(manager, index)
        for _ in range(6):  # bursts of 40 iterations between deliveries: drops every time
            sim.run(max_iterations=40)
            pipe.deliver()
        assert manager.stats().events_dropped_total > 0 and sim.stats().snapshots >= 1
        for _ in range(60):  # delivered every iteration: the next snapshot gets through whole
            sim.step()
            pipe.deliver()
            if not index.is_degraded(WORKER) and not manager.snapshot_requested:
                break
        assert not index.is_degraded(WORKER)
        assert_index_equals_truth(index, sim.ground_truth())
