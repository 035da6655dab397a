"""Timing engine iterations on a manager (per-call and per-flush nanoseconds), with a consumer
draining or the buffer full, and their summary (best/median of repeats, p50/p99/worst iteration)."""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from collections.abc import Callable
from typing import Any

from producer_ops import UPDATED


def run_iterations(
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


def with_consumer(m: Any) -> Callable[[], None]:
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


def fill(m: Any, capacity: int) -> None:
    for i in range(capacity):
        m.enqueue_updated_event(UPDATED, 32 + (i & 1))
    m.flush()
    m.settle(60)


def measure(
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
            fill(m, args.full_capacity)
        else:
            stopper = with_consumer(m)
        gap = 0.0 if scenario == "saturated" else args.gap_ms / 1000
        op_ns, flush_ns = run_iterations(m, op, args.calls, args.iterations, gap)
        m.settle(60)
        if stopper:
            stopper()
        m.close()
        means_op.append(statistics.fmean(op_ns))
        means_flush.append(statistics.fmean(flush_ns))
        all_op += op_ns
        all_flush += flush_ns
    return {"call": summary(means_op, all_op), "flush": summary(means_flush, all_flush)}


def summary(means_ns: list[float], iterations_ns: list[float]) -> dict[str, float]:
    """best/median of the repeats' means; p50/p99/max of single iterations (all in us)."""
    ordered = sorted(iterations_ns)
    return {
        "best_us": min(means_ns) / 1e3,
        "median_us": statistics.median(means_ns) / 1e3,
        "p50_iteration_us": ordered[len(ordered) // 2] / 1e3,
        "p99_iteration_us": ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))] / 1e3,
        "worst_iteration_us": ordered[-1] / 1e3,
    }
