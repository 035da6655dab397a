"""How many events/s and blocks/s one engine-simulator process generates (no Kafka, no MPI).

Runs the simulator as fast as it can over fixed simulated durations, with each event sink side
by side in one run (so a noisy 2-core machine affects them alike), repeats, and reports the best
and the median:

- ``none``: no event manager (the cost of the simulation alone);
- ``counting``: a manager that only counts calls;
- ``recording``: a fake that appends every call to a list (the unit tests' recording fake);
- ``manager``: the real ``KVCacheEventManager``, with a buffer large enough to
  drop nothing; its background worker builds the events, so the time until ``settle()`` is
  reported too.

Usage: ``python bench/simulator.py [--repeat 3] [--quick]``; prints a table and writes
``bench/results/simulator.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvevents.producer import KVCacheEventManager
from kvevents.producer.simulator import CountingEventManager, EngineSimulator, SimulatorConfig
from kvevents.producer.simulator.workload import WorkloadConfig, WorkloadGenerator

RESULTS = Path(__file__).resolve().parent / "results" / "simulator.json"


class RecordingSink:
    """Appends every call to a list, like the unit tests' recording fake."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def enqueue_created_event(self, levels: list[int], window_size: int) -> None:
        self.calls.append(("created", levels, window_size))

    def enqueue_stored_event(self, blocks: list[Any], window_size: int) -> None:
        self.calls.append(("stored", blocks, window_size))

    def enqueue_removed_event(self, block_hash: int, window_size: int) -> None:
        self.calls.append(("removed", block_hash, window_size))

    def enqueue_updated_event(self, data: Any, window_size: int) -> None:
        self.calls.append(("updated", data, window_size))

    def flush(self) -> None:
        self.calls.append(("flush",))


@dataclass(frozen=True)
class Scenario:
    name: str
    description: str
    config: SimulatorConfig
    workload: WorkloadConfig
    simulated_seconds: float


SCENARIOS = [
    Scenario(
        "default",
        "default config and workload (10 req/s, 1024 primary blocks of 32 tokens, no secondary)",
        SimulatorConfig(),
        WorkloadConfig(seed=1),
        600.0,
    ),
    Scenario(
        "pressure",
        "100 req/s, 512 primary + 512 secondary blocks: constant eviction, offload and onboarding",
        SimulatorConfig(num_primary_blocks=512, num_secondary_blocks=512, max_batch_size=128),
        WorkloadConfig(seed=1, request_rate=100.0),
        60.0,
    ),
]


def _sinks() -> dict[str, Callable[[], Any]]:
    return {
        "none": lambda: None,
        "counting": CountingEventManager,
        "recording": RecordingSink,
        "manager": lambda: KVCacheEventManager(max_kv_event_entries=50_000_000),
    }


def run_once(scenario: Scenario, make_sink: Callable[[], Any]) -> dict[str, float]:
    sink = make_sink()
    sim = EngineSimulator(scenario.config, sink, WorkloadGenerator(scenario.workload))
    start = time.perf_counter()
    stats = sim.run(duration_s=scenario.simulated_seconds)
    engine_s = time.perf_counter() - start
    settled_s = engine_s
    dropped = 0
    delivered = None
    if isinstance(sink, KVCacheEventManager):
        sink.settle(timeout=600)
        settled_s = time.perf_counter() - start
        manager_stats = sink.stats()
        dropped = manager_stats.buffer.events_dropped_total
        delivered = manager_stats.buffer.events_added_total
        sink.close()
    events = stats.events_enqueued
    touched = stats.stored_blocks + stats.removed_blocks + stats.updated_events
    return {
        "engine_s": engine_s,
        "settled_s": settled_s,
        "events": events,
        "stored_blocks": stats.stored_blocks,
        "blocks_touched": touched,
        "requests": stats.requests_served,
        "iterations": stats.iterations,
        "events_per_s": events / engine_s,
        "stored_blocks_per_s": stats.stored_blocks / engine_s,
        "blocks_touched_per_s": touched / engine_s,
        "requests_per_s": stats.requests_served / engine_s,
        "events_per_s_settled": events / settled_s,
        "hit_rate": stats.hit_rate,
        "dropped": dropped,
        "events_delivered": delivered,  # by the real manager, consecutive Removed calls merged
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="a tenth of the simulated time")
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    sinks = _sinks()
    results: list[dict[str, Any]] = []
    print(
        f"{'scenario':<9} {'sink':<10} {'events/s':>10} {'stored blk/s':>13} {'touched blk/s':>14} "
        f"{'req/s':>8} {'settled ev/s':>13} {'vs none':>8}"
    )
    for scenario in SCENARIOS:
        if args.quick:
            scenario = Scenario(
                scenario.name,
                scenario.description,
                scenario.config,
                scenario.workload,
                scenario.simulated_seconds / 10,
            )
        runs: dict[str, list[dict[str, float]]] = {name: [] for name in sinks}
        run_once(scenario, sinks["counting"])  # warm-up, discarded
        for _ in range(args.repeat):
            for name in runs:  # interleaved, so noise hits every sink alike
                runs[name].append(run_once(scenario, sinks[name]))
        base = max(r["events_per_s"] for r in runs["none"])
        for name, rs in runs.items():
            best = max(rs, key=lambda r: r["events_per_s"])
            row = {
                "scenario": scenario.name,
                "description": scenario.description,
                "sink": name,
                "repeat": args.repeat,
                "simulated_seconds": scenario.simulated_seconds,
                "best": best,
                "median_events_per_s": statistics.median(r["events_per_s"] for r in rs),
                "median_stored_blocks_per_s": statistics.median(r["stored_blocks_per_s"] for r in rs),
                "ratio_to_none": best["events_per_s"] / base,
            }
            results.append(row)
            print(
                f"{scenario.name:<9} {name:<10} {best['events_per_s']:>10,.0f} {best['stored_blocks_per_s']:>13,.0f} "
                f"{best['blocks_touched_per_s']:>14,.0f} {best['requests_per_s']:>8,.0f} "
                f"{best['events_per_s_settled']:>13,.0f} {row['ratio_to_none']:>8.2f}"
            )
    payload = {
        "name": "simulator",
        "python": sys.version.split()[0],
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count()},
        "results": results,
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(payload, indent=2) + "\n")
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
