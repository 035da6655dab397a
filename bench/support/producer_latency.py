"""The ``sink_latency`` section of ``bench/producer.py``: flush() to the Kafka acknowledgement at an
offered load, per linger.ms."""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

from kvevents.producer import KVCacheEventManager
from producer_kafka import BROKER, SINK_TARGETS, sink_config, sink_defaults
from producer_ops import BLOCKS_4X32, UPDATED


# engine iteration for the latency run: 5 calls -> 5 events (windows alternate, nothing merges)
def _latency_iteration(m: Any, calls: int, base: int) -> None:
    stored, removed, updated = m.enqueue_stored_event, m.enqueue_removed_event, m.enqueue_updated_event
    blocks, data = BLOCKS_4X32, UPDATED
    for h in range(base, base + calls, 5):
        stored(blocks, 32)
        removed(h, 16)
        updated(data, 32)
        removed(h + 1, 32)
        stored(blocks, 32)


def _flush_to_ack(bootstrap: str, linger_ms: float, seconds: float, rate: int, calls: int) -> dict[str, Any]:
    from kvevents.producer import KafkaEventSink

    topic = BROKER.topic("latency")
    reports: list[Any] = []
    manager = KVCacheEventManager(10_000_000, drop_warning_interval_s=3600)
    sink = KafkaEventSink(manager, topic, "bench-latency", config=sink_config(bootstrap, **{"linger.ms": linger_ms}),
                          on_delivery=reports.append)  # fmt: skip
    _latency_iteration(manager, 5, 0)
    manager.flush()
    if not (manager.settle(30) and sink.wait_delivered(60)):
        raise RuntimeError("the sink delivered nothing during warm-up: is Kafka up?")
    reports.clear()
    period = calls / rate
    flushes: list[tuple[float, int]] = []  # (flush time, last event id of the iteration)
    next_id = manager.stats().events_enqueued_total
    started = time.monotonic()
    next_at = started
    while next_at - started < seconds:
        _latency_iteration(manager, calls, next_id)
        manager.flush()
        next_id += calls
        flushes.append((time.monotonic(), next_id - 1))
        next_at += period
        delay = next_at - time.monotonic()
        if delay > 0:
            time.sleep(delay)
    elapsed = time.monotonic() - started
    manager.settle(30)
    sink.wait_delivered(60)
    sink.close(30)
    manager.close()
    acks = sorted(
        (r.sequence, r.last_event_id_by_rank.get(0, -1), r.acked_at, r.produced_at)
        for r in reports
        if r.delivered
    )
    latencies_ms, sink_ms, kafka_ms = [], [], []
    j = 0
    for flushed_at, last_id in flushes:  # both in order: walk them together
        while j < len(acks) and acks[j][1] < last_id:
            j += 1
        if j == len(acks):
            raise RuntimeError(f"event {last_id} was never acknowledged")
        latencies_ms.append((acks[j][2] - flushed_at) * 1e3)
        sink_ms.append((acks[j][3] - flushed_at) * 1e3)  # flush() to produce(): manager worker + sink
        kafka_ms.append((acks[j][2] - acks[j][3]) * 1e3)  # produce() to ack: librdkafka + broker
    ordered = sorted(latencies_ms)
    sink_ms.sort()
    kafka_ms.sort()

    def p99(values: list[float]) -> float:
        return values[min(len(values) - 1, int(len(values) * 0.99))]

    return {
        "flush_to_produce_p50_ms": sink_ms[len(sink_ms) // 2],
        "flush_to_produce_p99_ms": p99(sink_ms),
        "produce_to_ack_p50_ms": kafka_ms[len(kafka_ms) // 2],
        "produce_to_ack_p99_ms": p99(kafka_ms),
        "linger_ms": linger_ms,
        "offered_events_per_s": len(flushes) * calls / elapsed,
        "iterations": len(flushes),
        "messages": len(acks),
        "p50_ms": ordered[len(ordered) // 2],
        "p99_ms": p99(ordered),
        "max_ms": ordered[-1],
    }


def bench_sink_latency(args: argparse.Namespace) -> dict[str, Any]:
    """flush() to Kafka acknowledgement at the offered load, per linger.ms."""
    bootstrap = BROKER.get()
    # A run thrown away first: a freshly started broker's JVM is still compiling its hot paths.
    _flush_to_ack(bootstrap, args.sink_lingers[0], max(1.0, args.latency_seconds / 2), args.rate, 100)
    all_runs: dict[float, list[dict[str, Any]]] = {linger: [] for linger in args.sink_lingers}
    for _ in range(args.sink_repeats):  # interleaved: drift in the machine's load hits each alike
        for linger in args.sink_lingers:
            all_runs[linger].append(_flush_to_ack(bootstrap, linger, args.latency_seconds, args.rate, 100))
    out: dict[str, Any] = {}
    for linger, runs in all_runs.items():
        out[f"linger_{linger:g}ms"] = {
            "runs": runs,
            "p50_ms_median": statistics.median(r["p50_ms"] for r in runs),
            "p99_ms_median": statistics.median(r["p99_ms"] for r in runs),
            "p99_ms_best": min(r["p99_ms"] for r in runs),
            "flush_to_produce_p99_ms_median": statistics.median(r["flush_to_produce_p99_ms"] for r in runs),
            "produce_to_ack_p99_ms_median": statistics.median(r["produce_to_ack_p99_ms"] for r in runs),
            "offered_events_per_s_median": statistics.median(r["offered_events_per_s"] for r in runs),
        }
    default = sink_defaults()["linger.ms"]
    key = f"linger_{default:g}ms"
    return {
        "unit": "milliseconds from the engine's flush() to the broker's acknowledgement of the message holding the iteration's last event",
        "rate_events_per_s": args.rate,
        "events_per_iteration": 100,
        "seconds_per_run": args.latency_seconds,
        "broker": BROKER.source,
        "default_linger_ms": default,
        "target_p99_ms_max": SINK_TARGETS["flush_to_ack_p99_ms_max"],
        "meets_target_median": key in out
        and out[key]["p99_ms_median"] <= SINK_TARGETS["flush_to_ack_p99_ms_max"],
        **out,
    }
