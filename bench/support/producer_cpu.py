"""CPU seconds per thread of this process (Linux ``/proc``), for the sink throughput section's
per-thread cost."""

from __future__ import annotations

import os
import statistics
import threading


def thread_cpu_s() -> dict[str, float]:
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


def cpu_since(before: dict[str, float]) -> dict[str, float]:
    now = thread_cpu_s()
    return {
        name: round(cpu - before.get(name, 0.0), 3)
        for name, cpu in sorted(now.items())
        if cpu - before.get(name, 0.0) > 0
    }


def thread_medians(runs: list[dict[str, float]], events: int) -> dict[str, float]:
    """Per thread name, the median over runs of its CPU microseconds per event (0 where absent)."""
    names = sorted({name for run in runs for name in run})
    medians = {name: statistics.median(run.get(name, 0.0) for run in runs) / events * 1e6 for name in names}
    return {name: round(us, 3) for name, us in medians.items() if us >= 0.005}
