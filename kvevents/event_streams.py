"""Realistic KV-cache event streams in a real topic, with the ground truth of every worker's cache.

:func:`simulate_to_topic` runs engine simulators (:mod:`kvevents.producer.simulator`: prefix
sharing, offload to a secondary level, evictions) on real ``KVCacheEventManager``s, one per
attention-DP rank, drains them each iteration into one ``EventBatch`` per instance (sequence
numbers, in-band drops, creation time) and produces it keyed by instance id. The returned
:class:`ProducedStream` holds what was sent and each worker's :class:`GroundTruth` at the end,
so a test can check an index (``kvevents.verify.compare``) or a router's answers against it.
The pytest plugin's ``kvevents_stream`` fixture calls it.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvevents.producer import KVCacheEventManager
from kvevents.producer.simulator import EngineSimulator, GroundTruth, SimulatorConfig
from kvevents.producer.simulator.workload import Request, WorkloadConfig, WorkloadGenerator
from kvevents.schemas import EventBatch, KVCacheEvent, RankDrops, encode_batch

__all__ = ["DEFAULT_BLOCK_SIZE", "REALISTIC_WORKLOAD", "ProducedStream", "simulate_to_topic"]

REALISTIC_WORKLOAD = WorkloadConfig(
    seed=5, request_rate=40.0, system_prompt_tokens=(64, 256), document_tokens=(64, 384), num_documents=24,
    user_tokens=(8, 64), output_tokens=(4, 48), max_prompt_tokens=1200, follow_up_delay_s=0.1,
)  # fmt: skip
"""Shared system prompts and documents, follow-ups: prefixes that repeat across workers."""
DEFAULT_BLOCK_SIZE = 16


@dataclass
class ProducedStream:
    """What :func:`simulate_to_topic` produced and the truth about each worker's cache."""

    topic: str
    truths: list[GroundTruth]
    """Per worker (instance, attention-DP rank), the blocks its caches hold at the end."""
    sent: list[EventBatch]
    simulators: list[EngineSimulator]
    block_size: int
    workload: WorkloadConfig = REALISTIC_WORKLOAD

    @property
    def events(self) -> int:
        """How many events were produced."""
        return sum(len(b.events) for b in self.sent)

    @property
    def workers(self) -> list[tuple[str, int | None]]:
        """(instance_id, attention_dp_rank) of every worker."""
        return [t.worker for t in self.truths]

    def prompts(self, per_worker: int = 5, seed: int = 0) -> list[Request]:
        """Requests a router could be asked to place: ``per_worker`` new ones from each worker's
        workload (same system prompts and documents, so they share prefixes with what the
        workers cached). ``truth.prefix_hit_blocks(r.prompt, r.lora_id)`` is the right answer."""
        requests: list[Request] = []
        for truth in self.truths:
            worker = self.workload.for_worker(truth.instance_id, truth.attention_dp_rank)
            requests += WorkloadGenerator(worker).held_out(per_worker, seed=seed)
        return requests


def _producer(bootstrap: str, config: Mapping[str, Any] | None) -> Any:
    from confluent_kafka import Producer

    settings: dict[str, Any] = {
        "bootstrap.servers": bootstrap,
        "enable.idempotence": True,
        "linger.ms": 5,
        "partitioner": "murmur2_random",  # keys hashed as the Java client does
    }
    settings.update(config or {})
    return Producer(settings)


def simulate_to_topic(
    bootstrap: str,
    topic: str,
    *,
    instances: Sequence[str] = ("sim-a", "sim-b"),
    ranks: int = 2,
    iterations: int = 40,
    workload: WorkloadConfig = REALISTIC_WORKLOAD,
    block_size: int = DEFAULT_BLOCK_SIZE,
    num_primary_blocks: int = 96,
    num_secondary_blocks: int = 32,
    codec: Any = None,
    config: Mapping[str, Any] | None = None,
) -> ProducedStream:
    """Run every worker ``iterations`` engine iterations; after each, one batch per instance
    to ``topic`` (``codec``: e.g. a ``RegistryCodec``; default single-object framing).
    ``config``: more producer settings. Raises RuntimeError if a message is not delivered."""
    encode = encode_batch if codec is None else codec.encode_batch
    producer = _producer(bootstrap, config)
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
                    block_size=block_size,
                    num_primary_blocks=num_primary_blocks,
                    num_secondary_blocks=num_secondary_blocks,
                ),
                managers[name][r],
                WorkloadGenerator(workload.for_worker(name, r)),
            )
            for r in range(ranks)
        ]
    sequence = dict.fromkeys(instances, 0)
    sent: list[EventBatch] = []
    failures: list[Any] = []

    def delivered(err: Any, _message: object) -> None:
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
                    if not manager.settle(timeout=30):
                        raise RuntimeError(f"{name} rank {r}: the event manager did not settle in 30 s")
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
                producer.produce(topic, key=name.encode(), value=encode(batch), on_delivery=delivered)
                producer.poll(0)
                sent.append(batch)
        left = producer.flush(30)
        if left or failures:
            raise RuntimeError(
                f"{left} message(s) not delivered to {topic} in 30 s; failures: {failures[:3]}"
            )
    finally:
        for group in managers.values():
            for manager in group:
                manager.close()
    all_sims = [sim for name in instances for sim in sims[name]]
    truths = [sim.ground_truth() for sim in all_sims]
    return ProducedStream(topic, truths, sent, all_sims, block_size, workload)
