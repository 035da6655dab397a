"""A small simulated stream for the CLI's integration tests: engine simulators (with offload to
a secondary level, so there are Updated events) on real ``KVCacheEventManager``s, one per
attention-DP rank, drained per iteration into one ``EventBatch`` per instance (sequence
numbers, in-band drops, creation time) and produced to a real topic keyed by instance id."""

from __future__ import annotations

import time
from dataclasses import dataclass

from confluent_kafka import KafkaError
from kafka_streams import producer as kafka_producer
from kvevents.producer import KVCacheEventManager
from kvevents.producer.simulator import EngineSimulator, GroundTruth, SimulatorConfig
from kvevents.producer.simulator.workload import WorkloadConfig, WorkloadGenerator
from kvevents.schemas import EventBatch, KVCacheEvent, RankDrops, encode_batch

WORKLOAD = WorkloadConfig(
    seed=5, request_rate=40.0, system_prompt_tokens=(64, 256), document_tokens=(64, 384), num_documents=24,
    user_tokens=(8, 64), output_tokens=(4, 48), max_prompt_tokens=1200, follow_up_delay_s=0.1,
)  # fmt: skip
BLOCK_SIZE = 16


@dataclass
class Produced:
    truths: list[GroundTruth]
    sent: list[EventBatch]
    simulators: list[EngineSimulator]

    @property
    def events(self) -> int:
        return sum(len(b.events) for b in self.sent)


def simulate_to_topic(
    bootstrap: str,
    topic: str,
    *,
    instances: tuple[str, ...] = ("sim-a", "sim-b"),
    ranks: int = 2,
    iterations: int = 40,
    workload: WorkloadConfig = WORKLOAD,
) -> Produced:
    """Run every worker ``iterations`` iterations; each iteration, one batch per instance."""
    producer = kafka_producer(bootstrap)
    managers: dict[str, list[KVCacheEventManager]] = {}
    sims: dict[str, list[EngineSimulator]] = {}
    for name in instances:
        managers[name] = [
            KVCacheEventManager(
                100_000, attention_dp_rank=r, attention_dp_size=ranks, attention_dp_gather=False
            )
            for r in range(ranks)
        ]
        sims[name] = [
            EngineSimulator(
                SimulatorConfig(
                    instance_id=name,
                    attention_dp_rank=r,
                    block_size=BLOCK_SIZE,
                    num_primary_blocks=96,
                    num_secondary_blocks=32,
                ),
                managers[name][r],
                WorkloadGenerator(workload.for_worker(name, r)),
            )
            for r in range(ranks)
        ]
    sequence = dict.fromkeys(instances, 0)
    sent: list[EventBatch] = []
    failures: list[KafkaError] = []

    def delivered(err: KafkaError | None, _message: object) -> None:
        if err is not None:
            failures.append(err)

    try:
        for _ in range(iterations):
            for name in instances:
                collected: list[KVCacheEvent] = []
                dropped: list[RankDrops] = []
                for r, sim in enumerate(sims[name]):
                    sim.step()
                    manager = managers[name][r]
                    assert manager.settle(timeout=30)
                    drain = manager.drain(timeout=0)
                    collected.extend(drain.events)
                    dropped.extend(RankDrops(d.attention_dp_rank, d.dropped_events) for d in drain.dropped)
                if not collected and not dropped:
                    continue
                batch = EventBatch(
                    name, collected, attention_dp_size=ranks, producer_id=7, sequence=sequence[name],
                    created_at_us=time.time_ns() // 1000, dropped=dropped,
                )  # fmt: skip
                sequence[name] += 1
                producer.produce(
                    topic, key=name.encode(), value=encode_batch(batch),
                    on_delivery=delivered,
                )  # fmt: skip
                producer.poll(0)
                sent.append(batch)
        assert producer.flush(30) == 0 and not failures, failures
    finally:
        for group in managers.values():
            for manager in group:
                manager.close()
    all_sims = [sim for name in instances for sim in sims[name]]
    return Produced([sim.ground_truth() for sim in all_sims], sent, all_sims)
