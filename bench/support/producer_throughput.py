"""The ``sink_throughput`` section of ``bench/producer.py``: the Kafka sink against raw confluent-kafka
producing the sink's own messages, same settings, same run."""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from typing import Any

from kvevents.producer import KVCacheEventManager
from kvevents.schemas import (
    KVCacheEvent,
    KVCacheEventDiff,
    KVCacheRemovedData,
    KVCacheStoredBlockData,
    KVCacheStoredData,
    KVCacheUpdatedData,
)
from producer_cpu import cpu_since, thread_cpu_s, thread_medians
from producer_kafka import BROKER, SINK_TARGETS, sink_config, sink_defaults


def mixed_events(count: int, seed: int = 7) -> list[KVCacheEvent]:
    """Events like an engine's: ~50% Stored (4 blocks x 32 tokens from a 128k vocabulary), ~40%
    Removed, ~10% Updated, random 64-bit hashes (as in bench/codec.py)."""
    import random

    rng = random.Random(seed)
    events = []
    for event_id in range(count):
        kind = rng.random()
        if kind < 0.5:
            blocks = [
                KVCacheStoredBlockData(rng.getrandbits(64), [rng.randrange(128_256) for _ in range(32)])
                for _ in range(4)
            ]
            data: Any = KVCacheStoredData(rng.getrandbits(64), blocks)
        elif kind < 0.9:
            data = KVCacheRemovedData([rng.getrandbits(64) for _ in range(rng.randint(1, 4))])
        else:
            data = KVCacheUpdatedData(rng.getrandbits(64), priority=KVCacheEventDiff(35, rng.randrange(101)))
        events.append(KVCacheEvent(event_id, data, 32))
    return events


def _run_sink(
    events: list[KVCacheEvent], topic: str, per_message: int, config: dict[str, Any]
) -> dict[str, Any]:
    """Time the sink moving ``events`` (all in the manager's buffer at once) to acknowledged
    Kafka messages of at most ``per_message`` events; returns the seconds and the exact messages
    produced (for the raw baseline)."""
    from kvevents.producer import KafkaEventSink

    captured: list[bytes] = []
    warmup = mixed_events(50, seed=1)
    target = len(events) + len(warmup)
    done = threading.Event()
    delivered = [0]

    def on_delivery(report: Any) -> None:  # the sink's per-message report: cheaper than polling stats()
        if report.delivered:
            delivered[0] += report.events
            if delivered[0] >= target:
                done.set()

    manager = KVCacheEventManager(target + 10, drop_warning_interval_s=3600)
    capture = {"on_delivery": lambda err, msg: captured.append(msg.value()) if err is None else None}
    sink = KafkaEventSink(manager, topic, "bench-engine", config={**config, **capture}, on_delivery=on_delivery,
                          max_events_per_message=per_message)  # fmt: skip
    manager.buffer.extend(warmup)  # connects, fetches the topic's limit, gets a producer id
    if not sink.wait_delivered(60):
        raise RuntimeError("the sink delivered nothing during warm-up: is Kafka up?")
    captured.clear()
    threads_before = thread_cpu_s()
    cpu = time.process_time()
    started = time.perf_counter()
    manager.buffer.extend(events)
    if not done.wait(300):
        raise RuntimeError(f"the sink delivered {delivered[0]} of {target} events in 300 s")
    seconds = time.perf_counter() - started
    cpu = time.process_time() - cpu
    threads = cpu_since(threads_before)  # before close(): the sink's threads still run
    stats = sink.stats()
    sink.close(30)
    manager.close()
    return {"seconds": seconds, "cpu_s": cpu, "messages": list(captured), "stats": stats, "effective_config": sink.config,
            "thread_cpu_s": threads}  # fmt: skip


def _run_raw(
    values: list[bytes], topic: str, config: dict[str, Any]
) -> tuple[float, float, dict[str, float]]:
    """Time raw confluent-kafka producing ``values`` (same key, headers and librdkafka settings)
    until every one is acknowledged: wall seconds, CPU seconds of this process, per thread."""
    from confluent_kafka import Producer
    from kvevents.producer.sink import FINGERPRINT_HEADER
    from kvevents.schemas import CONTENT_TYPE, current_fingerprint

    producer = Producer(config)
    headers = [
        ("content-type", CONTENT_TYPE.encode()),
        (FINGERPRINT_HEADER, current_fingerprint().hex().encode()),
    ]
    delivered = [0]

    def on_delivery(err: Any, _msg: Any) -> None:
        if err is None:
            delivered[0] += 1

    producer.produce(topic, b"warm-up", b"bench-engine", on_delivery=on_delivery)
    producer.flush(60)
    delivered[0] = 0
    threads_before = thread_cpu_s()
    cpu = time.process_time()
    started = time.perf_counter()
    for value in values:
        while True:
            try:
                producer.produce(topic, value, b"bench-engine", headers=headers, on_delivery=on_delivery)
                break
            except BufferError:
                producer.poll(0.001)
        producer.poll(0)
    producer.flush(120)
    seconds = time.perf_counter() - started
    cpu = time.process_time() - cpu
    threads = cpu_since(threads_before)
    if delivered[0] != len(values):
        raise RuntimeError(f"raw producer delivered {delivered[0]} of {len(values)} messages")
    return seconds, cpu, threads


def bench_sink_throughput(args: argparse.Namespace) -> dict[str, Any]:
    """Sink vs raw confluent-kafka on the same bytes, same librdkafka settings, same run."""
    bootstrap = BROKER.get()
    events = mixed_events(args.sink_events)
    out: dict[str, Any] = {}
    for shape, per_message in (("large_messages", 2000), ("small_messages", 200)):
        runs = []
        previous: list[bytes] | None = None
        for repeat in range(args.sink_repeats):
            config = sink_config(bootstrap)
            # Alternate who goes first (odd repeats: raw first, on the previous sink run's bytes),
            # so that the broker's state (segments, page cache, JIT) favours neither.
            raw_first = repeat % 2 == 1 and previous is not None
            if raw_first:
                raw_s, raw_cpu, raw_threads = _run_raw(previous, BROKER.topic("raw"), _raw_config(config))  # type: ignore[arg-type]
                time.sleep(args.sink_pause)
            sink = _run_sink(events, BROKER.topic("sink"), per_message, config)
            time.sleep(args.sink_pause)  # let the broker finish writing before the next run
            if not raw_first:
                raw_s, raw_cpu, raw_threads = _run_raw(
                    sink["messages"], BROKER.topic("raw"), _raw_config(sink["effective_config"])
                )
                time.sleep(args.sink_pause)
            previous = sink["messages"]
            size = sum(len(v) for v in sink["messages"])
            runs.append({
                "sink_s": sink["seconds"], "raw_s": raw_s, "raw_first": raw_first,
                "messages": len(sink["messages"]), "bytes": size,
                "sink_events_per_s": len(events) / sink["seconds"], "raw_events_per_s": len(events) / raw_s,
                "ratio_sink_over_raw": raw_s / sink["seconds"],
                "sink_cpu_s": sink["cpu_s"], "raw_cpu_s": raw_cpu,
                "cpu_ratio_raw_over_sink": raw_cpu / sink["cpu_s"],
                "sink_thread_cpu_s": sink["thread_cpu_s"], "raw_thread_cpu_s": raw_threads,
            })  # fmt: skip
        ratios = [r["ratio_sink_over_raw"] for r in runs]
        out[shape] = {
            "events_per_message": per_message,
            "runs": runs,
            "ratio_median": statistics.median(ratios),
            "ratio_geometric_mean": statistics.geometric_mean(ratios),
            "cpu_ratio_raw_over_sink_median": statistics.median(r["cpu_ratio_raw_over_sink"] for r in runs),
            "sink_cpu_us_per_event_median": statistics.median(r["sink_cpu_s"] for r in runs)
            / len(events)
            * 1e6,
            "raw_cpu_us_per_event_median": statistics.median(r["raw_cpu_s"] for r in runs)
            / len(events)
            * 1e6,
            "sink_thread_cpu_us_per_event_median": thread_medians(
                [r["sink_thread_cpu_s"] for r in runs], len(events)
            ),
            "raw_thread_cpu_us_per_event_median": thread_medians(
                [r["raw_thread_cpu_s"] for r in runs], len(events)
            ),
            "ratio_best": max(ratios),
            "sink_events_per_s_median": statistics.median(r["sink_events_per_s"] for r in runs),
            "raw_events_per_s_median": statistics.median(r["raw_events_per_s"] for r in runs),
            "mb_per_s_sink_median": statistics.median(r["bytes"] / r["sink_s"] / 1e6 for r in runs),
            "mean_message_bytes": statistics.fmean(r["bytes"] / r["messages"] for r in runs),
        }
    return {
        "unit": "events/s from the manager's buffer to acknowledged by Kafka; raw = confluent-kafka producing the sink's own messages",
        "how": "all events in the manager's buffer at once; the sink drains, encodes, produces; raw produces the bytes the sink produced; runs alternate who goes first, with a pause between",
        "fairness": "raw gets the sink's effective librdkafka config (defaults included: compression, linger.ms, idempotence, acks, queue bounds) and produces the sink's own captured messages (same sizes, key, headers); the sink alone encodes Avro, on the same 2 cores as librdkafka's compression and the broker",
        "events": len(events),
        "broker": BROKER.source,
        "config": {k: v for k, v in sink_defaults().items()},
        "target_ratio_min": SINK_TARGETS["throughput_ratio_min"],
        "meets_target_median": all(
            v["ratio_median"] >= SINK_TARGETS["throughput_ratio_min"] for v in out.values()
        ),
        **out,
    }


def _raw_config(effective: dict[str, Any]) -> dict[str, Any]:
    """The sink's librdkafka settings (defaults included), for the raw producer."""
    from kvevents.producer import DEFAULT_PRODUCER_CONFIG

    config = {**DEFAULT_PRODUCER_CONFIG, **effective}
    return {
        k: v for k, v in config.items() if k not in ("client.id", "on_delivery", "logger") and not callable(v)
    }
