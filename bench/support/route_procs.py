"""The router bench's view of its server processes, read from ``/proc``: which processes serve,
their CPU and their wait for a core, wrk's CPU (finished children), proportional memory, and
niceness for a paced run (``bench/route_serve.py``)."""

from __future__ import annotations

import os
import resource
from pathlib import Path
from typing import Any


def tree_pss_mb(pid: int) -> dict[str, float]:
    """Proportional set size (shared pages split between sharers) of a process and its children."""
    out: dict[str, float] = {}
    todo = [pid]
    while todo:
        p = todo.pop()
        try:
            text = Path(f"/proc/{p}/smaps_rollup").read_text()
            pss = next(int(line.split()[1]) for line in text.splitlines() if line.startswith("Pss:"))
            out[str(p)] = round(pss / 1024, 1)
            for task in Path(f"/proc/{p}/task").iterdir():
                todo += [int(c) for c in (task / "children").read_text().split()]
        except (OSError, StopIteration):
            continue
    return out


def server_pids(pid: int) -> list[int]:
    """The processes that serve (the child itself with one worker, else its worker processes)."""
    kids = [
        int(c)
        for task in Path(f"/proc/{pid}/task").iterdir()
        for c in (task / "children").read_text().split()
    ]
    return kids or [pid]


def cpu_s(pids: list[int]) -> list[float]:
    """User + system CPU seconds of each process so far."""
    out = []
    for p in pids:
        fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
        out.append((int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK"))
    return out


def sched_wait(pids: list[int]) -> tuple[float, int]:
    """Seconds the processes' serving threads spent runnable but not running (waiting for a
    core), and how many times they were put on a core, so far (``/proc/PID/schedstat``)."""
    wait, slices = 0.0, 0
    for p in pids:
        for task in Path(f"/proc/{p}/task").iterdir():  # every thread (granian serves from Rust threads)
            try:
                fields = (task / "schedstat").read_text().split()
            except OSError:
                continue
            wait += int(fields[1]) / 1e9
            slices += int(fields[2])
    return wait, slices


def children_cpu_s() -> float:
    """User + system CPU of this process's finished children (the wrk runs)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run_counted(pids: list[int], load: Any, paced: bool = False) -> dict[str, Any]:
    """``load()``'s wrk figures plus each server process's share of the CPU the run took, the
    server CPU per request (a process that takes most of it took most of the connections), the
    servers' wait for a core per request, and wrk's CPU per request. A paced ``load`` is given
    ``on_measure``, called just before its measured run: the figures count that run only, not
    its probes and warm-up (they did until this session, inflating a paced step's CPU and wait
    per request by up to the probes' share, ~3 s of 4)."""
    start: list[Any] = []

    def mark() -> None:
        start[:] = [cpu_s(pids), sched_wait(pids), children_cpu_s()]

    mark()
    result: dict[str, Any] = load(on_measure=mark) if paced else load()
    before, sched_before, wrk = start
    used = [a - b for a, b in zip(cpu_s(pids), before, strict=True)]
    wait, slices = (a - b for a, b in zip(sched_wait(pids), sched_before, strict=True))
    total = sum(used)
    requests = max(1, result["requests"])
    result["cpu_share_by_process"] = [round(u / total, 2) if total else None for u in used]
    result["server_cpu_us_per_request"] = round(total / requests * 1e6, 1)
    result["server_runqueue_wait_us_per_request"] = round(wait / requests * 1e6, 1)
    result["server_slices_per_request"] = round(slices / requests, 2)
    result["wrk_cpu_us_per_request"] = round((children_cpu_s() - wrk) / requests * 1e6, 1)
    return result


def renice(pids: list[int], nice: int) -> None:
    """Every thread of the server processes at niceness ``nice`` (Linux: a thread's own)."""
    for p in pids:
        for task in Path(f"/proc/{p}/task").iterdir():
            try:
                os.setpriority(os.PRIO_PROCESS, int(task.name), nice)
            except (ProcessLookupError, FileNotFoundError):
                continue
