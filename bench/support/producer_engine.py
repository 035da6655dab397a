"""The ``engine_thread`` and ``worker`` sections of ``bench/producer.py``: the engine thread's cost
per call (manager vs naive baseline vs pure-Python path, per scenario) and the worker's events/s."""

from __future__ import annotations

import argparse
import functools
import statistics
import threading
import time
from typing import Any

from kvevents.producer import KVCacheEventManager
from producer_baselines import NaiveManager, NoopManager, PurePythonManager
from producer_ops import OPERATIONS, noop_op, removed_new, stored, updated
from producer_timing import measure

TARGETS_US = {
    "enqueue_removed_new": 1.0,
    "enqueue_removed_merged": 1.0,
    "enqueue_updated": 1.0,
    "enqueue_stored_4x32": 2.0,
    "flush": 5.0,
}


def bench_engine_thread(args: argparse.Namespace) -> dict[str, Any]:
    """The engine thread's cost per call, manager vs naive baseline, per scenario; the manager
    on its pure-Python engine path beside it (``manager_pure_python``), same run."""
    scenarios = ["draining", "full_nobody_draining", "saturated"]
    capacity_for = {
        "draining": 10_000_000,
        "saturated": 10_000_000,
        "full_nobody_draining": args.full_capacity,
    }
    results: dict[str, Any] = {}
    for scenario in scenarios:
        capacity = capacity_for[scenario]
        rows: dict[str, Any] = {}
        for name, op in OPERATIONS.items():
            manager = measure(functools.partial(KVCacheEventManager, capacity, drop_warning_interval_s=3600),
                               op, scenario, args)  # fmt: skip
            naive = measure(functools.partial(NaiveManager, capacity), op, scenario, args)
            pure = measure(functools.partial(PurePythonManager, capacity, drop_warning_interval_s=3600),
                            op, scenario, args)  # fmt: skip
            rows[name] = {
                "manager": manager["call"],
                "manager_pure_python": pure["call"],
                "ratio_pure_python_over_manager": pure["call"]["median_us"] / manager["call"]["median_us"],
                "naive": naive["call"],
                "ratio_naive_over_manager": naive["call"]["median_us"] / manager["call"]["median_us"],
                "flush_after_it": {
                    "manager": manager["flush"],
                    "naive": naive["flush"],
                    "manager_pure_python": pure["flush"],
                },
            }
        noop = measure(NoopManager, noop_op, "draining" if scenario != "saturated" else "saturated", args)
        rows["noop_call"] = {"floor": noop["call"]}
        # flush() of a typical mixed iteration: the flush timed after the stored rows.
        flush_manager = rows["enqueue_stored_4x32"]["flush_after_it"]["manager"]
        flush_naive = rows["enqueue_stored_4x32"]["flush_after_it"]["naive"]
        rows["flush"] = {
            "manager": flush_manager,
            "manager_pure_python": rows["enqueue_stored_4x32"]["flush_after_it"]["manager_pure_python"],
            "naive": flush_naive,
            "ratio_naive_over_manager": flush_naive["median_us"] / flush_manager["median_us"],
        }
        results[scenario] = rows
    meets = {
        scenario: {
            op: results[scenario][op]["manager"]["median_us"] <= target for op, target in TARGETS_US.items()
        }
        for scenario in scenarios
    }
    return {
        "unit": "microseconds per call on the engine thread",
        "calls_per_iteration": args.calls,
        "iterations_per_repeat": args.iterations,
        "repeats": args.repeats,
        "gap_ms_between_iterations": args.gap_ms,
        "full_capacity": args.full_capacity,
        "targets_us": TARGETS_US,
        "meets_targets_median": meets,
        "scenarios": results,
    }


def bench_worker_throughput(args: argparse.Namespace) -> dict[str, Any]:
    """Events per second the worker builds and buffers, measured with the engine idle: the
    records are queued while the worker is held back, then released and timed to the end."""
    out: dict[str, Any] = {}
    for name, op in (("stored_4x32", stored), ("removed_new", removed_new), ("updated", updated)):
        rates = []
        for _ in range(args.repeats):
            m = KVCacheEventManager(10_000_000, drop_warning_interval_s=3600)
            gate = threading.Event()
            # Private access, bench only: a marker that holds the worker until all is queued.
            marker = GateMarker(gate)
            m._pending.append(marker)
            m._worker.wake(now=True)
            marker.entered.wait(10)  # the worker is held: nothing below is built before the clock
            iterations = max(20, args.iterations)
            for i in range(iterations):
                op(m, args.calls, i * args.calls)
                m.flush()
            events = m.stats().events_enqueued_total
            start = time.perf_counter()
            gate.set()
            m.settle(300)
            rates.append(events / (time.perf_counter() - start))
            m.close()
        out[name] = {"events_per_s_best": max(rates), "events_per_s_median": statistics.median(rates)}
    return {"unit": "events built and buffered per second by the background worker", **out}


class GateMarker(threading.Event):
    """A settle marker the worker 'sets'; setting it first waits for the gate to open."""

    def __init__(self, gate: threading.Event) -> None:
        super().__init__()
        self._gate = gate
        self.entered = threading.Event()

    def set(self) -> None:
        self.entered.set()
        self._gate.wait()
        super().set()
