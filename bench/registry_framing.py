"""Reading a topic written with a schema registry: what Confluent's framing costs a rebuild.

The same realistic stream (:func:`kvevents.event_streams.simulate_to_topic`'s simulators, no
Kafka: batches kept in memory) is encoded three ways and applied to a fresh ``CacheIndex``
through ``consumer._framing.index_applier``, as ``EventReader.apply_to`` does:

- ``single_object``: the default framing, ``apply_encoded`` (the compiled core reads the body);
- ``confluent_reframed``: Confluent framing, current schema: re-framed (header swap, one copy)
  then ``apply_encoded`` (the reader's path with a ``RegistryCodec``);
- ``confluent_decoded``: Confluent framing decoded to ``EventBatch`` objects and applied
  (the path for an older writer schema), the baseline the re-framing avoids.

The in-memory (mock://) registry answers the one schema lookup. Rounds interleave; the best
counts. Run: ``python bench/registry_framing.py``; writes ``bench/results/registry_framing.json``.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path
from typing import Any

from confluent_kafka.schema_registry import SchemaRegistryClient
from kvevents.consumer import CacheIndex
from kvevents.consumer._framing import index_applier
from kvevents.schemas import EventBatch, encode_batch
from kvevents.schemas.registry import RegistryCodec

RESULTS = Path(__file__).with_name("results") / "registry_framing.json"


def _batches(iterations: int) -> list[EventBatch]:
    from kvevents.producer import KVCacheEventManager
    from kvevents.producer.simulator import EngineSimulator, SimulatorConfig
    from kvevents.producer.simulator.workload import WorkloadGenerator

    from kvevents.event_streams import REALISTIC_WORKLOAD

    out: list[EventBatch] = []
    for w in range(4):
        name = f"bench-{w}"
        with KVCacheEventManager(1_000_000) as manager:
            sim = EngineSimulator(
                SimulatorConfig(
                    instance_id=name, block_size=16, num_primary_blocks=512, num_secondary_blocks=128
                ),
                manager,
                WorkloadGenerator(REALISTIC_WORKLOAD.for_worker(name, None)),
            )
            for _ in range(iterations):
                sim.step()
                manager.settle(timeout=30)
                events = manager.drain(timeout=0).events
                if events:
                    out.append(
                        EventBatch(
                            name, list(events), sequence=len([b for b in out if b.instance_id == name])
                        )
                    )
    return out


class _NoReframe:
    """A codec without ``as_single_object``: every Confluent message is decoded, then applied."""

    def __init__(self, codec: RegistryCodec) -> None:
        self.decode_batch = codec.decode_batch


def _run(messages: list[bytes], codec: Any) -> float:
    index = CacheIndex()
    apply = index_applier(index, codec)
    started = time.perf_counter()
    for message in messages:
        apply(message)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=1500, help="engine iterations per simulated worker")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    batches = _batches(args.iterations)
    events = sum(len(b.events) for b in batches)
    codec = RegistryCodec(SchemaRegistryClient.new_client({"url": "mock://bench"}), "bench")
    cases = {
        "single_object": ([encode_batch(b) for b in batches], None),
        "confluent_reframed": ([codec.encode_batch(b) for b in batches], codec),
        "confluent_decoded": ([codec.encode_batch(b) for b in batches], _NoReframe(codec)),
    }
    best = dict.fromkeys(cases, float("inf"))
    for _ in range(args.rounds):
        for name, (messages, used) in cases.items():
            best[name] = min(best[name], _run(messages, used))
    rates = {name: events / seconds for name, seconds in best.items()}
    base = rates["single_object"]
    print(f"{len(batches)} batches, {events} events; best of {args.rounds} rounds")
    print(f"{'path':<20} {'events/s':>12} {'vs single_object':>17}")
    for name, rate in rates.items():
        print(f"{name:<20} {rate:>12,.0f} {rate / base:>16.2f}x")
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(
        json.dumps(
            {
                "batches": len(batches),
                "events": events,
                "rounds": args.rounds,
                "events_per_s": {k: round(v) for k, v in rates.items()},
                "ratio_to_single_object": {k: round(v / base, 3) for k, v in rates.items()},
                "python": platform.python_version(),
            },
            indent=1,
        )
        + "\n"
    )


if __name__ == "__main__":
    main()
