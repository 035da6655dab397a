"""CPU per thread of a command's process tree: ``python bench/support/thread_cpu.py -- CMD ...``.

Samples ``/proc/PID/task/TID/stat`` of the command and its descendants every 0.2 s and prints,
once it ends, the threads that used the most CPU (user + system), named as the kernel knows them
(librdkafka names its threads ``rdk:main``, ``rdk:broker1``, ...). Used to find where the ranks'
cores go at a freshness step (docs/OPERATIONS.md, "The sink's hand-off window").
"""

from __future__ import annotations

import argparse
import os
import subprocess
import time
from collections import defaultdict
from pathlib import Path

TICKS_PER_SECOND = os.sysconf("SC_CLK_TCK")


def _stat_fields(path: Path) -> tuple[str, list[str]]:
    text = path.read_text()
    return text[text.index("(") + 1 : text.rindex(")")], text.rsplit(")", 1)[1].split()


def descendants(root: int) -> list[int]:
    """``root`` and every process below it."""
    children: dict[int, list[int]] = defaultdict(list)
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                children[int(_stat_fields(entry / "stat")[1][1])].append(int(entry.name))
            except (OSError, ValueError, IndexError):
                continue
    tree, i = [root], 0
    while i < len(tree):
        tree += children.get(tree[i], [])
        i += 1
    return tree


def sample(root: int, seen: dict[tuple[int, int], tuple[str, str, float]]) -> None:
    """Record the CPU seconds of every thread under ``root`` (the last value wins)."""
    for pid in descendants(root):
        try:
            command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:70]
            for task in Path(f"/proc/{pid}/task").iterdir():
                name, fields = _stat_fields(task / "stat")
                seconds = (int(fields[11]) + int(fields[12])) / TICKS_PER_SECOND
                seen[(pid, int(task.name))] = (command, name, seconds)
        except (OSError, ValueError, IndexError):
            continue  # gone meanwhile


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--top", type=int, default=25, help="threads to print (default 25)")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the command, after --")
    args = parser.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the command to run after --")
    seen: dict[tuple[int, int], tuple[str, str, float]] = {}
    started = time.monotonic()
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL)
    while proc.poll() is None:
        sample(proc.pid, seen)
        time.sleep(0.2)
    wall = time.monotonic() - started
    print(f"{'pid':>7} {'tid':>7} {'thread':16} {'cpu s':>6}  command")
    for (pid, tid), (cmd, name, seconds) in sorted(seen.items(), key=lambda kv: -kv[1][2])[: args.top]:
        print(f"{pid:7d} {tid:7d} {name:16} {seconds:6.2f}  {cmd}")
    total = sum(seconds for _, _, seconds in seen.values())
    print(
        f"all threads: {total:.2f} s of CPU in {wall:.1f} s = {total / wall:.2f} cores (exit {proc.returncode})"
    )


if __name__ == "__main__":
    main()
