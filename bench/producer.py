"""Producer benchmark: what kvevents costs an engine, and how fast the producer moves events.

Sections (run all, or pick with ``--sections``; each writes its own key of the JSON, so a run of
one section keeps the others' last results):

- ``engine_thread``: cost per call of each ``enqueue_*`` and of ``flush()`` on the engine thread,
  next to the naive baseline (the same API building the full event objects on the engine thread,
  as a line-by-line port of the C++ does), in the same run. Scenarios: a consumer draining; the
  buffer full with nobody draining (every flush drops); and ``saturated`` (no pause between
  iterations, so the worker competes with the engine for the GIL all the time).
- ``worker``: how many events per second the background worker builds and buffers.

An engine iteration here is ``--calls`` calls of one operation, timed as a block (per call = block
/ calls; the Python loop and call overhead are included, the ``noop`` row shows them), then
``flush()``, timed alone, then ``--gap-ms`` of sleep standing for the GPU work during which a real
engine releases the GIL (the worker and consumer run then). Each repeat runs ``--iterations``
iterations; best = the fastest repeat's mean, median = the median of the repeats' means,
worst_iteration = the slowest single iteration of all (per call), which shows any blocking.

    python bench/producer.py              # full run, table + bench/results/producer.json
    python bench/producer.py --quick      # a smoke run
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import os
import platform
import queue
import statistics
import sys
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from kvevents.producer import BlockInfo, EventBuffer, KVCacheEventManager
from kvevents.producer._recorder import PyRecorder
from kvevents.schemas import (
    PRIMARY_LEVEL,
    SECONDARY_LEVEL,
    KVCacheCreatedData,
    KVCacheEvent,
    KVCacheEventDiff,
    KVCacheRemovedData,
    KVCacheStoredBlockData,
    KVCacheStoredData,
    KVCacheUpdatedData,
)

RESULTS = Path(__file__).resolve().parent / "results" / "producer.json"

TARGETS_US = {
    "enqueue_removed_new": 1.0,
    "enqueue_removed_merged": 1.0,
    "enqueue_updated": 1.0,
    "enqueue_stored_4x32": 2.0,
    "flush": 5.0,
}


# ---- the naive baseline: build the events on the engine thread ------------------------------


class NaiveManager:
    """The same engine API, building ``KVCacheEvent``/``KVCacheStoredBlockData`` objects in
    each ``enqueue_*`` (the C++ design, ``enqueueEvent({mEventId++, data, ...})``, ported
    directly), handing each iteration off with a list swap + ``queue.SimpleQueue.put`` (the
    straightforward choice; it wakes the blocked worker with a system call each flush, which the
    manager's polled deque avoids) and the same ``EventBuffer`` behind it."""

    def __init__(self, capacity: int, rank: int | None = None) -> None:
        self._rank = rank
        self._queue: list[KVCacheEvent] = []
        self._next_id = 0
        self.buffer = EventBuffer(capacity, drop_warning_interval_s=3600)
        self._pending: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._work, daemon=True)
        self._thread.start()

    def _work(self) -> None:
        while (events := self._pending.get()) is not None:
            if isinstance(events, threading.Event):
                events.set()
            else:
                self.buffer.extend(events)

    def enqueue_created_event(self, levels: list[int], window_size: int) -> None:
        self._queue.append(
            KVCacheEvent(self._next_id, KVCacheCreatedData(list(levels)), window_size, self._rank)
        )
        self._next_id += 1

    def enqueue_stored_event(self, blocks: list[BlockInfo], window_size: int) -> None:
        if not blocks:
            return
        data = KVCacheStoredData(
            blocks[0].prev_block_hash,
            [
                KVCacheStoredBlockData(
                    b.block_hash,
                    b.tokens,
                    b.lora_id,
                    PRIMARY_LEVEL if b.is_primary else SECONDARY_LEVEL,
                    b.priority,
                    b.token_extra_ids,
                    b.mm_keys,
                    b.cache_salt,
                )
                for b in blocks
            ],
        )
        self._queue.append(KVCacheEvent(self._next_id, data, window_size, self._rank))
        self._next_id += 1

    def enqueue_removed_event(self, block_hash: int, window_size: int) -> None:
        q = self._queue
        if q and q[-1].window_size == window_size and q[-1].data.__class__ is KVCacheRemovedData:
            q[-1].data.block_hashes.append(block_hash)  # type: ignore[union-attr]
        else:
            q.append(KVCacheEvent(self._next_id, KVCacheRemovedData([block_hash]), window_size, self._rank))
            self._next_id += 1

    def enqueue_updated_event(self, data: KVCacheUpdatedData, window_size: int) -> None:
        self._queue.append(KVCacheEvent(self._next_id, data, window_size, self._rank))
        self._next_id += 1

    def flush(self) -> None:
        events = self._queue
        if not events:
            return
        self._queue = []
        self._pending.put(events)

    def drain(self, timeout: float | None = None) -> Any:
        return self.buffer.drain(timeout)

    def settle(self, timeout: float | None = None) -> bool:
        marker = threading.Event()
        self._pending.put(marker)
        return marker.wait(timeout)

    def close(self) -> None:
        self._pending.put(None)
        self._thread.join()
        self.buffer.close()


class NoopManager:
    """Same signatures, no work: the floor (Python loop + method call) of every row."""

    def enqueue_updated_event(self, data: object, window_size: int) -> None:
        pass

    def flush(self) -> None:
        pass

    def drain(self, timeout: float | None = None) -> None:
        time.sleep(timeout or 0)

    def settle(self, timeout: float | None = None) -> bool:
        return True

    def close(self) -> None:
        pass


# ---- one engine iteration per operation -------------------------------------------------------

BLOCKS_4X32 = [BlockInfo(1000 + i, (999 + i) if i else None, range(32 * i, 32 * i + 32)) for i in range(4)]
UPDATED = KVCacheUpdatedData(77, priority=KVCacheEventDiff(35, 90))
LEVELS = [4096, 1024]


def _removed_new(m: Any, calls: int, base: int) -> None:
    enqueue = m.enqueue_removed_event
    for h in range(base, base + calls, 2):  # alternating windows: every call opens a new event
        enqueue(h, 16)
        enqueue(h + 1, 32)


def _removed_merged(m: Any, calls: int, base: int) -> None:
    enqueue = m.enqueue_removed_event
    for h in range(base, base + calls):  # same window: appended to the open Removed event
        enqueue(h, 32)


def _updated(m: Any, calls: int, base: int) -> None:
    enqueue, data = m.enqueue_updated_event, UPDATED
    for _ in range(calls):
        enqueue(data, 32)


def _stored(m: Any, calls: int, base: int) -> None:
    enqueue, blocks = m.enqueue_stored_event, BLOCKS_4X32
    for _ in range(calls):
        enqueue(blocks, 32)


def _created(m: Any, calls: int, base: int) -> None:
    enqueue = m.enqueue_created_event
    for _ in range(calls):
        enqueue(LEVELS, 32)


def _noop(m: Any, calls: int, base: int) -> None:
    enqueue, data = m.enqueue_updated_event, UPDATED
    for _ in range(calls):
        enqueue(data, 32)


OPERATIONS: dict[str, Callable[[Any, int, int], None]] = {
    "enqueue_removed_new": _removed_new,
    "enqueue_removed_merged": _removed_merged,
    "enqueue_updated": _updated,
    "enqueue_stored_4x32": _stored,
    "enqueue_created": _created,
}
"""Each runs ``calls`` calls of one operation (``flush`` is timed after every one of them)."""


def _run_iterations(
    m: Any, op: Callable[[Any, int, int], None], calls: int, iterations: int, gap_s: float
) -> tuple[list[float], list[float]]:
    """Per-call nanoseconds of each iteration's op block, and of each flush."""
    op_ns: list[float] = []
    flush_ns: list[float] = []
    clock = time.perf_counter_ns
    flush = m.flush
    base = 0
    for _ in range(iterations):
        t0 = clock()
        op(m, calls, base)
        t1 = clock()
        flush()
        t2 = clock()
        op_ns.append((t1 - t0) / calls)
        flush_ns.append(float(t2 - t1))
        base += calls
        if gap_s:
            time.sleep(gap_s)
    return op_ns, flush_ns


def _with_consumer(m: Any) -> Callable[[], None]:
    """Start a thread draining ``m`` continuously; returns its stopper."""
    stop = threading.Event()

    def consume() -> None:
        while not stop.is_set():
            m.drain(timeout=0.01)

    thread = threading.Thread(target=consume, daemon=True)
    thread.start()

    def stopper() -> None:
        stop.set()
        thread.join()

    return stopper


def _fill(m: Any, capacity: int) -> None:
    for i in range(capacity):
        m.enqueue_updated_event(UPDATED, 32 + (i & 1))
    m.flush()
    m.settle(60)


def _measure(
    make: Callable[[], Any], op: Callable[[Any, int, int], None], scenario: str, args: argparse.Namespace
) -> dict[str, Any]:
    means_op: list[float] = []
    means_flush: list[float] = []
    all_op: list[float] = []
    all_flush: list[float] = []
    for _ in range(args.repeats):
        m = make()
        stopper = None
        if scenario == "full_nobody_draining":
            _fill(m, args.full_capacity)
        else:
            stopper = _with_consumer(m)
        gap = 0.0 if scenario == "saturated" else args.gap_ms / 1000
        op_ns, flush_ns = _run_iterations(m, op, args.calls, args.iterations, gap)
        m.settle(60)
        if stopper:
            stopper()
        m.close()
        means_op.append(statistics.fmean(op_ns))
        means_flush.append(statistics.fmean(flush_ns))
        all_op += op_ns
        all_flush += flush_ns
    return {"call": _summary(means_op, all_op), "flush": _summary(means_flush, all_flush)}


def _summary(means_ns: list[float], iterations_ns: list[float]) -> dict[str, float]:
    """best/median of the repeats' means; p50/p99/max of single iterations (all in us)."""
    ordered = sorted(iterations_ns)
    return {
        "best_us": min(means_ns) / 1e3,
        "median_us": statistics.median(means_ns) / 1e3,
        "p50_iteration_us": ordered[len(ordered) // 2] / 1e3,
        "p99_iteration_us": ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))] / 1e3,
        "worst_iteration_us": ordered[-1] / 1e3,
    }


class PurePythonManager(KVCacheEventManager):
    """The manager on its pure-Python engine path (the fallback of the compiled recorder)."""

    _recorder_factory = PyRecorder


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
            manager = _measure(functools.partial(KVCacheEventManager, capacity, drop_warning_interval_s=3600),
                               op, scenario, args)  # fmt: skip
            naive = _measure(functools.partial(NaiveManager, capacity), op, scenario, args)
            pure = _measure(functools.partial(PurePythonManager, capacity, drop_warning_interval_s=3600),
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
        noop = _measure(NoopManager, _noop, "draining" if scenario != "saturated" else "saturated", args)
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
    for name, op in (("stored_4x32", _stored), ("removed_new", _removed_new), ("updated", _updated)):
        rates = []
        for _ in range(args.repeats):
            m = KVCacheEventManager(10_000_000, drop_warning_interval_s=3600)
            gate = threading.Event()
            # Private access, bench only: a marker that holds the worker until all is queued.
            marker = _GateMarker(gate)
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


class _GateMarker(threading.Event):
    """A settle marker the worker 'sets'; setting it first waits for the gate to open."""

    def __init__(self, gate: threading.Event) -> None:
        super().__init__()
        self._gate = gate
        self.entered = threading.Event()

    def set(self) -> None:
        self.entered.set()
        self._gate.wait()
        super().set()


# ---- the Kafka sink: throughput against raw confluent-kafka, flush-to-ack latency, Kafka down ----

SINK_TARGETS = {"throughput_ratio_min": 0.8, "flush_to_ack_p99_ms_max": 50.0}


class _Broker:
    """The Kafka the sink sections use: ``KAFKA_BOOTSTRAP_SERVERS``, else a local broker started
    once in a temporary directory (its JVM flags from ``KVEVENTS_BROKER_JVM_OPTS``)."""

    def __init__(self) -> None:
        self._broker: Any = None
        self._tmp: Any = None
        self.bootstrap: str | None = os.environ.get("KAFKA_BOOTSTRAP_SERVERS") or None
        self.source = "env" if self.bootstrap else None

    def get(self) -> str:
        if self.bootstrap is None:
            import tempfile

            from kvevents.broker import LocalBroker

            self._tmp = tempfile.TemporaryDirectory(prefix="kvevents-bench-broker-")
            self._broker = LocalBroker(Path(self._tmp.name) / "state", stop_with_parent=True)
            self._broker.start()
            self.bootstrap = self._broker.bootstrap_servers
            jvm = os.environ.get("KVEVENTS_BROKER_JVM_OPTS")
            self.source = f"local broker (JVM flags: {'default fast-start' if jvm is None else repr(jvm)})"
        return self.bootstrap

    def topic(self, stem: str, partitions: int = 1) -> str:
        import uuid

        from kvevents.consumer.topics import TopicSpec, create_topic

        name = f"bench-{stem}-{uuid.uuid4().hex[:8]}"
        create_topic(self.get(), TopicSpec(name, partitions=partitions))
        return name

    def stop(self) -> None:
        if self._broker is not None:
            self._broker.stop()
            self._broker = None
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None


BROKER = _Broker()


def _mixed_events(count: int, seed: int = 7) -> list[KVCacheEvent]:
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


def _thread_cpu_s() -> dict[str, float]:
    """CPU seconds used so far by each live thread of this process, by name (Python threads by
    their ``threading`` name, librdkafka's by their OS name, e.g. ``rdk:broker1``); Linux only,
    else empty. A run's per-thread cost is the difference of two readings taken while its
    threads are alive."""
    names = {t.native_id: t.name for t in threading.enumerate()}
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    out: dict[str, float] = {}
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/comm") as comm, open(f"/proc/self/task/{tid}/stat") as stat:
                name = names.get(int(tid)) or comm.read().strip()
                fields = stat.read().rsplit(")", 1)[1].split()
        except OSError:
            continue  # the thread ended meanwhile
        name = name.split(" (")[0]
        out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / tick
    return out


def _cpu_since(before: dict[str, float]) -> dict[str, float]:
    now = _thread_cpu_s()
    return {
        name: round(cpu - before.get(name, 0.0), 3)
        for name, cpu in sorted(now.items())
        if cpu - before.get(name, 0.0) > 0
    }


def _sink_config(bootstrap: str, **extra: Any) -> dict[str, Any]:
    return {"bootstrap.servers": bootstrap, "log_level": 3, **extra}


def _run_sink(
    events: list[KVCacheEvent], topic: str, per_message: int, config: dict[str, Any]
) -> dict[str, Any]:
    """Time the sink moving ``events`` (all in the manager's buffer at once) to acknowledged
    Kafka messages of at most ``per_message`` events; returns the seconds and the exact messages
    produced (for the raw baseline)."""
    from kvevents.producer import KafkaEventSink

    captured: list[bytes] = []
    warmup = _mixed_events(50, seed=1)
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
    threads_before = _thread_cpu_s()
    cpu = time.process_time()
    started = time.perf_counter()
    manager.buffer.extend(events)
    if not done.wait(300):
        raise RuntimeError(f"the sink delivered {delivered[0]} of {target} events in 300 s")
    seconds = time.perf_counter() - started
    cpu = time.process_time() - cpu
    threads = _cpu_since(threads_before)  # before close(): the sink's threads still run
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
    threads_before = _thread_cpu_s()
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
    threads = _cpu_since(threads_before)
    if delivered[0] != len(values):
        raise RuntimeError(f"raw producer delivered {delivered[0]} of {len(values)} messages")
    return seconds, cpu, threads


def bench_sink_throughput(args: argparse.Namespace) -> dict[str, Any]:
    """Sink vs raw confluent-kafka on the same bytes, same librdkafka settings, same run."""
    bootstrap = BROKER.get()
    events = _mixed_events(args.sink_events)
    out: dict[str, Any] = {}
    for shape, per_message in (("large_messages", 2000), ("small_messages", 200)):
        runs = []
        previous: list[bytes] | None = None
        for repeat in range(args.sink_repeats):
            config = _sink_config(bootstrap)
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
            "sink_thread_cpu_us_per_event_median": _thread_medians(
                [r["sink_thread_cpu_s"] for r in runs], len(events)
            ),
            "raw_thread_cpu_us_per_event_median": _thread_medians(
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
        "fairness": "raw gets the sink's effective librdkafka config (defaults included: zstd, linger.ms, idempotence, acks, queue bounds) and produces the sink's own captured messages (same sizes, key, headers); the sink alone encodes Avro, on the same 2 cores as librdkafka's compression and the broker",
        "events": len(events),
        "broker": BROKER.source,
        "config": {k: v for k, v in _sink_defaults().items()},
        "target_ratio_min": SINK_TARGETS["throughput_ratio_min"],
        "meets_target_median": all(
            v["ratio_median"] >= SINK_TARGETS["throughput_ratio_min"] for v in out.values()
        ),
        **out,
    }


def _thread_medians(runs: list[dict[str, float]], events: int) -> dict[str, float]:
    """Per thread name, the median over runs of its CPU microseconds per event (0 where absent)."""
    names = sorted({name for run in runs for name in run})
    medians = {name: statistics.median(run.get(name, 0.0) for run in runs) / events * 1e6 for name in names}
    return {name: round(us, 3) for name, us in medians.items() if us >= 0.005}


def _raw_config(sink_config: dict[str, Any]) -> dict[str, Any]:
    """The sink's librdkafka settings (defaults included), for the raw producer."""
    from kvevents.producer import DEFAULT_PRODUCER_CONFIG

    config = {**DEFAULT_PRODUCER_CONFIG, **sink_config}
    return {
        k: v for k, v in config.items() if k not in ("client.id", "on_delivery", "logger") and not callable(v)
    }


def _sink_defaults() -> dict[str, Any]:
    from kvevents.producer import DEFAULT_PRODUCER_CONFIG

    return dict(DEFAULT_PRODUCER_CONFIG)


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
    sink = KafkaEventSink(manager, topic, "bench-latency", config=_sink_config(bootstrap, **{"linger.ms": linger_ms}),
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
        "p99_ms": ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))],
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
    default = _sink_defaults()["linger.ms"]
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
        sink = KafkaEventSink(m, BROKER.topic("engine"), "bench-up", config=_sink_config(bootstrap))
        return functools.partial(sink.close, 30)

    def down(m: KVCacheEventManager) -> Callable[[], object]:
        sink = KafkaEventSink(m, "bench-down", "bench-down", topic_config_timeout=1.0,
                              config=_sink_config(dead, log_level=0), max_queued_events=5_000)  # fmt: skip
        return functools.partial(sink.close, 0.5)

    scenarios: dict[str, Callable[[KVCacheEventManager], Callable[[], object]]] = {
        "no_sink": _with_consumer,
        "sink_broker_up": up,
        "sink_broker_down": down,
    }
    ops = {"enqueue_stored_4x32": _stored, "enqueue_updated": _updated, "enqueue_removed_new": _removed_new}
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
                op_ns, flush_ns = _run_iterations(m, op, args.calls, args.iterations, args.gap_ms / 1000)
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
                "call": _summary(samples[(scenario, name)]["means_op"], samples[(scenario, name)]["op"]),
                "flush": _summary(
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


def print_sink_throughput(result: dict[str, Any]) -> None:
    print(f"\nsink throughput, {result['events']:,} events ({result['broker']})")
    print(f"{'messages':<16}{'sink ev/s':>14}{'raw ev/s':>14}{'sink/raw':>10}{'best':>8}{'MB/s':>8}{'msg bytes':>11}"
          f"{'cpu us/ev sink':>16}{'raw':>6}")  # fmt: skip
    for shape in ("large_messages", "small_messages"):
        row = result[shape]
        print(f"{shape:<16}{row['sink_events_per_s_median']:>14,.0f}{row['raw_events_per_s_median']:>14,.0f}"
              f"{row['ratio_median']:>10.2f}{row['ratio_best']:>8.2f}{row['mb_per_s_sink_median']:>8.1f}"
              f"{row['mean_message_bytes']:>11,.0f}{row['sink_cpu_us_per_event_median']:>16.2f}"
              f"{row['raw_cpu_us_per_event_median']:>6.2f}")  # fmt: skip
    for shape in ("large_messages", "small_messages"):
        row = result[shape]
        for who in ("sink", "raw"):
            threads = ", ".join(
                f"{name} {us:.2f}" for name, us in row[f"{who}_thread_cpu_us_per_event_median"].items()
            )
            print(f"  {shape} {who}: CPU us/event by thread (median): {threads}")
    print(
        f"target sink/raw >= {result['target_ratio_min']}: {'met' if result['meets_target_median'] else 'NOT met'}"
    )


def print_sink_latency(result: dict[str, Any]) -> None:
    print(f"\nflush() -> Kafka ack at {result['rate_events_per_s']:,} events/s offered ({result['broker']})")
    print(f"{'linger.ms':<12}{'offered ev/s':>14}{'p50 ms':>9}{'p99 ms':>9}{'best p99':>10}"
          f"{'p99 flush->produce':>20}{'p99 produce->ack':>18}")  # fmt: skip
    for key, row in result.items():
        if key.startswith("linger_"):
            print(f"{key[7:]:<12}{row['offered_events_per_s_median']:>14,.0f}{row['p50_ms_median']:>9.1f}"
                  f"{row['p99_ms_median']:>9.1f}{row['p99_ms_best']:>10.1f}"
                  f"{row['flush_to_produce_p99_ms_median']:>20.1f}{row['produce_to_ack_p99_ms_median']:>18.1f}")  # fmt: skip
    print(f"target p99 <= {result['target_p99_ms_max']} ms at the default linger.ms={result['default_linger_ms']}: "
          f"{'met' if result['meets_target_median'] else 'NOT met'}")  # fmt: skip


def print_sink_engine(result: dict[str, Any]) -> None:
    print("\nengine thread with a sink, us per call: median (best; p99 iteration; worst iteration)")
    print(f"{'scenario':<20}{'operation':<24}{'call':>34}{'flush':>34}")
    for scenario, rows in result["scenarios"].items():
        for op, row in rows.items():
            c, f = row["call"], row["flush"]
            print(f"{scenario:<20}{op:<24}"
                  f"{c['median_us']:>9.3f} ({c['best_us']:.3f}; {c['p99_iteration_us']:.2f}; {c['worst_iteration_us']:.1f})"
                  f"{f['median_us']:>9.2f} ({f['best_us']:.2f}; {f['p99_iteration_us']:.1f}; {f['worst_iteration_us']:.1f})")  # fmt: skip
    for op, r in result["ratios"].items():
        print(f"  {op}: broker down / no sink: call x{r['call_median_down_over_no_sink']:.2f}, "
              f"flush x{r['flush_median_down_over_no_sink']:.2f}; broker down / up: call x{r['call_median_down_over_up']:.2f} "
              f"(p99 x{r['call_p99_down_over_up']:.2f}), flush x{r['flush_median_down_over_up']:.2f} "
              f"(p99 x{r['flush_p99_down_over_up']:.2f})")  # fmt: skip


SECTIONS: dict[str, Callable[[argparse.Namespace], dict[str, Any]]] = {
    "engine_thread": bench_engine_thread,
    "worker": bench_worker_throughput,
    "sink_engine_kafka_down": bench_sink_engine_kafka_down,
    "sink_latency": bench_sink_latency,
    "sink_throughput": bench_sink_throughput,  # last: it writes GBs, whose writeback slows the broker a while
}
"""Section name -> function returning its JSON. Other parts of the producer add theirs here."""


# ---- output -------------------------------------------------------------------------------


def print_engine_table(result: dict[str, Any]) -> None:
    print(f"\nengine thread, us per call: median of {result['repeats']} repeats (best repeat; p99 iteration)")
    header = (
        f"{'scenario':<22}{'operation':<25}{'manager':>22}{'pure-python path':>22}{'naive':>22}{'naive/mgr':>10}"
        f"{'target':>8}"
    )
    print(header)
    print("-" * len(header))
    for scenario, rows in result["scenarios"].items():
        for op, row in rows.items():
            if op == "noop_call":
                f = row["floor"]
                print(f"{scenario:<22}{'(python call floor)':<25}{_fmt(f):>22}")
                continue
            if op == "flush":
                ratio = row["naive"]["median_us"] / row["manager"]["median_us"]
                print(f"{scenario:<22}{'flush (50 x stored)':<25}{_fmt(row['manager']):>22}"
                      f"{_fmt(row['manager_pure_python']):>22}{_fmt(row['naive']):>22}"
                      f"{ratio:>10.1f}{TARGETS_US['flush']:>8.1f}")  # fmt: skip
                continue
            op_target = TARGETS_US.get(op)
            print(
                f"{scenario:<22}{op:<25}{_fmt(row['manager']):>22}{_fmt(row['manager_pure_python']):>22}"
                f"{_fmt(row['naive']):>22}"
                f"{row['ratio_naive_over_manager']:>10.1f}{'' if op_target is None else f'{op_target:.1f}':>8}"
            )


def _fmt(stats: dict[str, float]) -> str:
    return f"{stats['median_us']:.3f} ({stats['best_us']:.3f}; {stats['p99_iteration_us']:.1f})"


def print_worker_table(result: dict[str, Any]) -> None:
    print("\nbackground worker, events built and buffered per second (median; best)")
    for name, row in result.items():
        if isinstance(row, dict):
            print(f"  {name:<16}{row['events_per_s_median']:>12,.0f}{row['events_per_s_best']:>12,.0f}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--sections", default=",".join(SECTIONS), help="comma-separated: " + ", ".join(SECTIONS)
    )
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--iterations", type=int, default=300, help="engine iterations per repeat")
    parser.add_argument("--calls", type=int, default=50, help="calls of the operation per iteration")
    parser.add_argument("--gap-ms", type=float, default=2.0, help="GIL-free pause between iterations")
    parser.add_argument("--full-capacity", type=int, default=1000, help="buffer size of the full scenario")
    parser.add_argument("--sink-events", type=int, default=300_000, help="events per sink throughput run")
    parser.add_argument("--sink-repeats", type=int, default=5, help="repeats of each sink run")
    parser.add_argument(
        "--sink-pause", type=float, default=2.0, help="seconds of rest for the broker between runs"
    )
    parser.add_argument("--sink-lingers", type=lambda v: [float(x) for x in v.split(",")], default=[0.0, 5.0, 20.0],
                        help="linger.ms values of the latency runs (comma-separated)")  # fmt: skip
    parser.add_argument(
        "--latency-seconds", type=float, default=5.0, help="seconds of offered load per latency run"
    )
    parser.add_argument("--rate", type=int, default=100_000, help="offered events/s of the latency runs")
    parser.add_argument("--quick", action="store_true", help="a smoke run: few repeats and iterations")
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    logging.getLogger("kvevents").setLevel(logging.ERROR)  # the full scenario drops on purpose
    if args.quick:
        args.repeats, args.iterations = 2, 30
        args.sink_events, args.sink_repeats, args.latency_seconds, args.sink_pause = 20_000, 1, 1.0, 0.2
    chosen = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = [s for s in chosen if s not in SECTIONS]
    if unknown:
        parser.error(f"unknown sections {unknown}; choose from {list(SECTIONS)}")

    document: dict[str, Any] = {}
    if args.output.exists():
        try:
            document = json.loads(args.output.read_text())
        except json.JSONDecodeError:
            document = {}
    document.setdefault("sections", {})
    document["benchmark"] = "producer"
    document["machine"] = {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
    }
    try:
        _run_sections(chosen, args, argv, document)
    finally:
        BROKER.stop()
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(document, indent=2, sort_keys=True) + "\n")
    print(f"\nwrote {args.output}")
    return 0


PRINTERS: dict[str, Callable[[dict[str, Any]], None]] = {
    "engine_thread": print_engine_table,
    "worker": print_worker_table,
    "sink_engine_kafka_down": print_sink_engine,
    "sink_latency": print_sink_latency,
    "sink_throughput": print_sink_throughput,
}


def _run_sections(
    chosen: list[str], args: argparse.Namespace, argv: list[str] | None, document: dict[str, Any]
) -> None:
    for name in chosen:
        started = time.perf_counter()
        result = SECTIONS[name](args)
        result["measured_at"] = datetime.now(UTC).isoformat(timespec="seconds")
        result["seconds"] = round(time.perf_counter() - started, 1)
        result["command"] = " ".join(
            ["python bench/producer.py", *(argv if argv is not None else sys.argv[1:])]
        )
        document["sections"][name] = result
        PRINTERS[name](result)


if __name__ == "__main__":
    raise SystemExit(main())
