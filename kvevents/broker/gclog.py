"""The local broker's garbage-collection log: where it is written and the pauses it records.

Every stop-the-world pause of the broker's JVM holds every produce and fetch request, so a
pause shows up whole in a latency tail. The broker writes one line per collection with its
wall-clock end time (``-Xlog:gc``, two rotated files of 4 MB); ``read_gc_pauses`` reads them
back for ``bench/freshness.py`` and for people (docs/OPERATIONS.md "The local broker").
"""

from __future__ import annotations

import os
import re
import subprocess
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

__all__ = ["GC_LOG_NAME", "GcPause", "gc_log_option", "pauses_between", "read_gc_pauses", "request_full_gc"]

GC_LOG_NAME = "gc.log"
"""The log's file name in the broker's state directory (rotated to ``gc.log.0``, ``gc.log.1``)."""

_ROTATED_FILES = 2
_LINE = re.compile(
    r"^\[(?P<time>\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d+[+-]\d{4})\].*?"
    r"GC\(\d+\) (?P<kind>Pause [A-Za-z ]+?)(?: \([^)]*\))*(?: \S*->\S*)? (?P<ms>\d+(?:\.\d+)?)ms$"
)


@dataclass(frozen=True)
class GcPause:
    """One stop-the-world pause: when it ended (Unix seconds), how long it took, its kind."""

    end_s: float
    ms: float
    kind: str

    @property
    def start_s(self) -> float:
        return self.end_s - self.ms / 1000.0


def gc_log_option(path: Path) -> str | None:
    """The JVM flag that writes the pauses to ``path`` with wall-clock times, rotated (the path
    quoted: ``:``, ``,`` and ``=`` separate -Xlog's fields); None for a path with a double quote,
    which -Xlog cannot name."""
    if '"' in str(path):
        return None
    return f'-Xlog:gc:file="{path}":time:filecount={_ROTATED_FILES},filesize=4m'


def read_gc_pauses(path: Path) -> list[GcPause]:
    """Every pause recorded in ``path`` and its rotated files, oldest first (an absent log has none).

    Lines that are not a pause (the collector's name, concurrent phases) are skipped.
    """
    files = [path.with_name(f"{path.name}.{k}") for k in range(_ROTATED_FILES)] + [path]
    pauses: list[GcPause] = []
    for file in files:
        try:
            text = file.read_text(encoding="utf-8", errors="replace")
        except OSError:
            continue
        pauses.extend(_parse(text.splitlines()))
    pauses.sort(key=lambda p: p.end_s)
    return pauses


def pauses_between(pauses: Iterable[GcPause], start_s: float, end_s: float) -> list[GcPause]:
    """The pauses that overlap ``[start_s, end_s]`` (Unix seconds)."""
    return [p for p in pauses if p.end_s >= start_s and p.start_s <= end_s]


def _parse(lines: Iterable[str]) -> Iterable[GcPause]:
    for line in lines:
        match = _LINE.match(line.rstrip())
        if match is None:
            continue
        try:
            when = datetime.strptime(match["time"], "%Y-%m-%dT%H:%M:%S.%f%z").timestamp()
        except ValueError:  # a damaged line that only looks like a time
            continue
        yield GcPause(when, float(match["ms"]), match["kind"])


def request_full_gc(pid: int, java: str) -> bool:
    """Ask the JVM ``pid`` for a full collection (``jcmd PID GC.run``, with the jcmd of the JDK
    whose launcher is ``java``); False when that JDK has no jcmd or the JVM did not answer."""
    jcmd = Path(os.path.realpath(java)).with_name("jcmd")
    if not jcmd.exists():
        return False
    done = subprocess.run([str(jcmd), str(pid), "GC.run"], capture_output=True, timeout=60, check=False)
    return done.returncode == 0
