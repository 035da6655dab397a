"""Where a freshness step's time goes (``bench/freshness.py``): each sampled event's stages
from its flush log and Avro stamps, the broker's GC pauses the produce stage waited through,
and the cores the step used."""

from __future__ import annotations

import bisect
import json
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

from kvevents.schemas import decode_batch

from kvevents.broker.gclog import pauses_between, read_gc_pauses

STAGES = ("sink", "gather_sink", "produce", "fetch", "apply")


class SampledTail(Protocol):
    """What ``stage_latencies`` reads of the measuring consumer: its sampled messages (value,
    broker append time in ms or -1, handed-over and applied times on the monotonic clock)."""

    samples: list[tuple[bytes, int, float, float]]


def wall_minus_monotonic() -> float:
    """``time.time() - time.monotonic()`` (the tightest of a few reads): moves this machine's
    wall-clock stamps onto the monotonic clock every process of it shares."""
    best: tuple[float, float] | None = None
    for _ in range(20):
        a = time.monotonic()
        w = time.time()
        b = time.monotonic()
        if best is None or b - a < best[0]:
            best = (b - a, w - (a + b) / 2)
    assert best is not None
    return best[1]


def stage_latencies(
    tail: SampledTail,
    flush_dir: Path,
    offset: float,
    settle_s: float = 0.0,
    produce_spans: list[tuple[float, float]] | None = None,
) -> dict[str, list[float]]:
    """Per sampled event: the whole path (``e2e``) and each stage, in seconds, for the events
    flushed ``settle_s`` or more after the step's first flush; ``e2e_all``: the whole path of
    every sampled event (the producer's start included). ``produce_spans`` receives each
    measured event's produce stage as (created, appended) on this process's monotonic clock."""
    flushes: dict[tuple[str, int], tuple[list[int], list[float]]] = {}
    for path in flush_dir.glob("flush-*.json"):
        log = json.loads(path.read_text())
        flushes[(log["instance_id"], log["attention_dp_rank"])] = (
            [f[0] for f in log["flushes"]],
            [f[1] for f in log["flushes"]],
        )
    first = min((times[0] for _, times in flushes.values() if times), default=0.0)
    out: dict[str, list[float]] = {name: [] for name in ("e2e", "e2e_all", *STAGES)}
    for value, append_ms, handed, applied in tail.samples:
        batch = decode_batch(value)
        if not batch.events or not batch.created_at_us:
            continue
        created = batch.created_at_us / 1e6 - offset
        appended = append_ms / 1000 - offset if append_ms >= 0 else None
        for event in batch.events:
            found = flushes.get((batch.instance_id, event.attention_dp_rank or 0))
            if found is None:
                continue
            i = bisect.bisect_left(found[0], event.event_id)
            if i == len(found[1]):
                continue
            flushed = found[1][i]
            out["e2e_all"].append(applied - flushed)
            if flushed - first < settle_s:
                continue
            out["e2e"].append(applied - flushed)
            out["sink" if not event.attention_dp_rank else "gather_sink"].append(created - flushed)
            out["apply"].append(applied - handed)
            if appended is not None:
                out["produce"].append(appended - created)
                out["fetch"].append(handed - appended)
                if produce_spans is not None:
                    produce_spans.append((created, appended))
    return out


def broker_gc(
    gc_log: Path | None, spans: Sequence[tuple[float, float]], offset: float
) -> dict[str, Any] | None:
    """The broker's stop-the-world GC pauses while the step's measured events were produced
    (None when its log is unknown: a broker this bench did not start, without ``--broker-gc-log``),
    and the share of the slowest 1% of produce-stage samples that waited through one of them."""
    if gc_log is None or not spans:
        return None
    start, end = min(c for c, _ in spans) + offset, max(a for _, a in spans) + offset
    pauses = pauses_between(read_gc_pauses(gc_log), start, end)
    slowest = sorted(spans, key=lambda span: span[1] - span[0])[-max(1, len(spans) // 100) :]
    waited = sum(
        1 for c, a in slowest if any(p.end_s - offset >= c and p.start_s - offset <= a for p in pauses)
    )
    longest = max(pauses, key=lambda p: p.ms, default=None)
    return {
        "pauses": len(pauses),
        "max_ms": longest.ms if longest else 0.0,
        "longest_kind": longest.kind if longest else None,
        "total_ms": round(sum(p.ms for p in pauses), 1),
        "slowest_produce_in_pause": round(waited / len(slowest), 2),
    }


def cpu_ticks() -> tuple[int, int]:
    """(busy, total) jiffies of all this machine's CPUs so far (``/proc/stat``; (0, 0) elsewhere)."""
    try:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return 0, 0
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    return sum(fields) - idle, sum(fields)


def cpu_report(
    ticks: tuple[tuple[int, int], tuple[int, int]], ranks_s: float, consumer_s: float, seconds: float
) -> dict[str, float | None]:
    """Cores in use during a step: the whole machine (every process, other users' too), the
    ranks (``mpiexec`` and its children), this process (the measuring consumer), and the rest
    (the broker, when it runs here, and anything else on the machine)."""
    (busy0, total0), (busy1, total1) = ticks
    cpus = os.cpu_count() or 1
    machine = None if total1 <= total0 else cpus * (busy1 - busy0) / (total1 - total0)
    ranks, consumer = ranks_s / seconds, consumer_s / seconds
    return {
        "cores": cpus,
        "machine_cores_busy": None if machine is None else round(machine, 2),
        "ranks_cores": round(ranks, 2),
        "consumer_cores": round(consumer, 2),
        "other_cores": None if machine is None else round(max(0.0, machine - ranks - consumer), 2),
    }
