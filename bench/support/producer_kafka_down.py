"""The ``sink_engine_kafka_down`` section of ``bench/producer.py``: the engine thread's cost with a
sink whose broker is down, next to a healthy broker and no sink."""

from __future__ import annotations

import argparse
import functools
import statistics
from collections.abc import Callable
from typing import Any

from kvevents.producer import KVCacheEventManager
from producer_kafka import BROKER, sink_config
from producer_ops import removed_new, stored, updated
from producer_timing import run_iterations, summary, with_consumer


def bench_sink_engine_kafka_down(args: argparse.Namespace) -> dict[str, Any]:
    """The engine thread's enqueue/flush cost with a sink whose broker is stopped (connections
    refused; the sink's queue overflows and drops), next to a healthy broker and no sink at all."""
    import socket

    from kvevents.producer import KafkaEventSink

    with socket.socket() as probe:  # a port where nothing listens: a stopped broker
        probe.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{probe.getsockname()[1]}"
    bootstrap = BROKER.get()

    def up(m: KVCacheEventManager) -> Callable[[], object]:
        sink = KafkaEventSink(m, BROKER.topic("engine"), "bench-up", config=sink_config(bootstrap))
        return functools.partial(sink.close, 30)

    def down(m: KVCacheEventManager) -> Callable[[], object]:
        sink = KafkaEventSink(m, "bench-down", "bench-down", topic_config_timeout=1.0,
                              config=sink_config(dead, log_level=0), max_queued_events=5_000)  # fmt: skip
        return functools.partial(sink.close, 0.5)

    scenarios: dict[str, Callable[[KVCacheEventManager], Callable[[], object]]] = {
        "no_sink": with_consumer,
        "sink_broker_up": up,
        "sink_broker_down": down,
    }
    ops = {"enqueue_stored_4x32": stored, "enqueue_updated": updated, "enqueue_removed_new": removed_new}
    samples: dict[tuple[str, str], dict[str, list[float]]] = {
        (scenario, name): {"means_op": [], "means_flush": [], "op": [], "flush": []}
        for scenario in scenarios
        for name in ops
    }
    # Interleaved (repeat > scenario > operation): the machine's background load hits every
    # scenario alike.
    for _ in range(args.repeats):
        for scenario, attach in scenarios.items():
            for name, op in ops.items():
                m = KVCacheEventManager(1_000_000, drop_warning_interval_s=3600)
                detach = attach(m)
                op_ns, flush_ns = run_iterations(m, op, args.calls, args.iterations, args.gap_ms / 1000)
                m.close()
                detach()
                row = samples[(scenario, name)]
                row["means_op"].append(statistics.fmean(op_ns))
                row["means_flush"].append(statistics.fmean(flush_ns))
                row["op"] += op_ns
                row["flush"] += flush_ns
    out: dict[str, Any] = {
        scenario: {
            name: {
                "call": summary(samples[(scenario, name)]["means_op"], samples[(scenario, name)]["op"]),
                "flush": summary(
                    samples[(scenario, name)]["means_flush"], samples[(scenario, name)]["flush"]
                ),
            }
            for name in ops
        }
        for scenario in scenarios
    }
    ratios = {
        name: {
            "call_median_down_over_no_sink": out["sink_broker_down"][name]["call"]["median_us"] / out["no_sink"][name]["call"]["median_us"],
            "flush_median_down_over_no_sink": out["sink_broker_down"][name]["flush"]["median_us"] / out["no_sink"][name]["flush"]["median_us"],
            "call_median_down_over_up": out["sink_broker_down"][name]["call"]["median_us"] / out["sink_broker_up"][name]["call"]["median_us"],
            "flush_median_down_over_up": out["sink_broker_down"][name]["flush"]["median_us"] / out["sink_broker_up"][name]["flush"]["median_us"],
            "call_p99_down_over_up": out["sink_broker_down"][name]["call"]["p99_iteration_us"] / out["sink_broker_up"][name]["call"]["p99_iteration_us"],
            "flush_p99_down_over_up": out["sink_broker_down"][name]["flush"]["p99_iteration_us"] / out["sink_broker_up"][name]["flush"]["p99_iteration_us"],
        }
        for name in ops
    }  # fmt: skip
    return {
        "unit": "microseconds per call on the engine thread (flush: per flush() call)",
        "calls_per_iteration": args.calls,
        "iterations_per_repeat": args.iterations,
        "repeats": args.repeats,
        "gap_ms_between_iterations": args.gap_ms,
        "broker_down_means": "connections refused (nothing listens on the port); sink queue bound 5000 events, so it overflows",
        "scenarios": out,
        "ratios": ratios,
    }
