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
        self._queue.append(KVCacheEvent(self._next_id, KVCacheCreatedData(list(levels)), window_size, self._rank))
        self._next_id += 1

    def enqueue_stored_event(self, blocks: list[BlockInfo], window_size: int) -> None:
        if not blocks:
            return
        data = KVCacheStoredData(
            blocks[0].prev_block_hash,
            [
                KVCacheStoredBlockData(
                    b.block_hash, b.tokens, b.lora_id, PRIMARY_LEVEL if b.is_primary else SECONDARY_LEVEL,
                    b.priority, b.token_extra_ids, b.mm_keys, b.cache_salt,
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


def bench_engine_thread(args: argparse.Namespace) -> dict[str, Any]:
    """The engine thread's cost per call, manager vs naive baseline, per scenario."""
    scenarios = ["draining", "full_nobody_draining", "saturated"]
    capacity_for = {"draining": 10_000_000, "saturated": 10_000_000, "full_nobody_draining": args.full_capacity}
    results: dict[str, Any] = {}
    for scenario in scenarios:
        capacity = capacity_for[scenario]
        rows: dict[str, Any] = {}
        for name, op in OPERATIONS.items():
            manager = _measure(functools.partial(KVCacheEventManager, capacity, drop_warning_interval_s=3600),
                               op, scenario, args)  # fmt: skip
            naive = _measure(functools.partial(NaiveManager, capacity), op, scenario, args)
            rows[name] = {
                "manager": manager["call"],
                "naive": naive["call"],
                "ratio_naive_over_manager": naive["call"]["median_us"] / manager["call"]["median_us"],
                "flush_after_it": {"manager": manager["flush"], "naive": naive["flush"]},
            }
        noop = _measure(NoopManager, _noop, "draining" if scenario != "saturated" else "saturated", args)
        rows["noop_call"] = {"floor": noop["call"]}
        # flush() of a typical mixed iteration: the flush timed after the stored rows.
        flush_manager = rows["enqueue_stored_4x32"]["flush_after_it"]["manager"]
        flush_naive = rows["enqueue_stored_4x32"]["flush_after_it"]["naive"]
        rows["flush"] = {
            "manager": flush_manager,
            "naive": flush_naive,
            "ratio_naive_over_manager": flush_naive["median_us"] / flush_manager["median_us"],
        }
        results[scenario] = rows
    meets = {
        scenario: {
            op: results[scenario][op]["manager"]["median_us"] <= target
            for op, target in TARGETS_US.items()
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


SECTIONS: dict[str, Callable[[argparse.Namespace], dict[str, Any]]] = {
    "engine_thread": bench_engine_thread,
    "worker": bench_worker_throughput,
}
"""Section name -> function returning its JSON. Other parts of the producer add theirs here."""


# ---- output -------------------------------------------------------------------------------


def print_engine_table(result: dict[str, Any]) -> None:
    print(f"\nengine thread, us per call: median of {result['repeats']} repeats (best repeat; p99 iteration)")
    header = f"{'scenario':<22}{'operation':<25}{'manager':>22}{'naive':>22}{'naive/mgr':>10}{'target':>8}"
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
                print(f"{scenario:<22}{'flush (50 x stored)':<25}{_fmt(row['manager']):>22}{_fmt(row['naive']):>22}"
                      f"{ratio:>10.1f}{TARGETS_US['flush']:>8.1f}")  # fmt: skip
                continue
            op_target = TARGETS_US.get(op)
            print(
                f"{scenario:<22}{op:<25}{_fmt(row['manager']):>22}{_fmt(row['naive']):>22}"
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
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sections", default=",".join(SECTIONS), help="comma-separated: " + ", ".join(SECTIONS))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--iterations", type=int, default=300, help="engine iterations per repeat")
    parser.add_argument("--calls", type=int, default=50, help="calls of the operation per iteration")
    parser.add_argument("--gap-ms", type=float, default=2.0, help="GIL-free pause between iterations")
    parser.add_argument("--full-capacity", type=int, default=1000, help="buffer size of the full scenario")
    parser.add_argument("--quick", action="store_true", help="a smoke run: few repeats and iterations")
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    logging.getLogger("kvevents").setLevel(logging.ERROR)  # the full scenario drops on purpose
    if args.quick:
        args.repeats, args.iterations = 2, 30
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
    for name in chosen:
        started = time.perf_counter()
        result = SECTIONS[name](args)
        result["measured_at"] = datetime.now(UTC).isoformat(timespec="seconds")
        result["seconds"] = round(time.perf_counter() - started, 1)
        result["command"] = " ".join(["python bench/producer.py", *(argv if argv is not None else sys.argv[1:])])
        document["sections"][name] = result
        if name == "engine_thread":
            print_engine_table(result)
        elif name == "worker":
            print_worker_table(result)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(document, indent=2, sort_keys=True) + "\n")
    print(f"\nwrote {args.output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
