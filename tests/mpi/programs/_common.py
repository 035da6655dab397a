"""Shared by the programs that ``tests/mpi`` runs under ``mpiexec``.

Each program writes one JSON result per rank (``rank<r>.json`` in ``--out``) and logs to
``rank<r>.log`` there; nothing goes to stdout/stderr unless a program fails (with hydra, a
survivor's output after a peer was SIGKILLed makes mpiexec kill the job at once).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvevents.producer import BlockInfo, EventDrain, KVCacheEventManager
from kvevents.schemas import KVCacheEvent, KVCacheEventDiff, KVCacheUpdatedData

WINDOW = 32


def world_rank() -> int:
    """This process's rank, from the launcher's environment (before MPI is imported)."""
    return int(os.environ.get("PMI_RANK", os.environ.get("OMPI_COMM_WORLD_RANK", "0")))


def parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--out", type=Path, required=True, help="directory for rank<r>.json and rank<r>.log")
    p.add_argument("--period-ms", type=float, default=5.0)
    return p


def setup_logging(out: Path, rank: int) -> None:
    out.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(out / f"rank{rank}.log")
    handler.setFormatter(logging.Formatter("%(relativeCreated)8.0f %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.INFO)


def write_json(out: Path, name: str, data: dict[str, Any]) -> None:
    """Atomically write ``out/<name>.json`` (a reader never sees half a file)."""
    tmp = out / f".{name}.json.tmp"
    tmp.write_text(json.dumps(data, sort_keys=True, default=str))
    tmp.rename(out / f"{name}.json")


def write_result(out: Path, rank: int, result: dict[str, Any]) -> None:
    """This rank's result, ``rank<r>.json``."""
    write_json(out, f"rank{rank}", result)


def wait_for(predicate: Callable[[], bool], timeout: float, interval: float = 0.01) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() >= deadline:
            return False
        time.sleep(interval)
    return True


def enqueue_iteration(manager: KVCacheEventManager, rng: random.Random, events: int, rank: int) -> None:
    """Enqueue ``events`` mixed events (Stored chains, Removed, Updated, sometimes Created) and
    flush: one engine iteration. Removed events use distinct windows in a row, so none merge and
    every call is one event id."""
    for i in range(events):
        kind = rng.random()
        if kind < 0.4:
            base = rng.getrandbits(60)
            blocks = [
                BlockInfo(base + b + 1, base + b if b else None, [rank, i, b] * 4)
                for b in range(rng.randint(1, 4))
            ]
            manager.enqueue_stored_event(blocks, WINDOW)
        elif kind < 0.75:
            manager.enqueue_removed_event(rng.getrandbits(64), WINDOW + (i % 2) + 1)
        elif kind < 0.98:
            manager.enqueue_updated_event(
                KVCacheUpdatedData(rng.getrandbits(64), priority=KVCacheEventDiff(35, 90)), WINDOW
            )
        else:
            manager.enqueue_created_event([1000, 100], WINDOW)
    manager.flush()


def ids_by_rank(events: list[KVCacheEvent]) -> dict[int, list[int]]:
    got: dict[int, list[int]] = {}
    for event in events:
        got.setdefault(event.attention_dp_rank if event.attention_dp_rank is not None else -1, []).append(
            event.event_id
        )
    return got


def fail(out: Path, rank: int, message: str) -> None:
    """Record a program failure where the test will see it, then exit non-zero."""
    write_result(out, rank, {"error": message})
    print(f"rank {rank}: {message}", file=sys.stderr, flush=True)
    sys.exit(3)


class DrainingReader:
    """Rank 0's reader thread, as a Kafka sink would be: ``drain`` until the manager's buffer is
    closed and empty, keeping every event (``got``) and the drops per source rank (``drops``);
    ``on_drain(drain, now)`` sees each drain, ``pause_s`` sleeps between drains."""

    def __init__(
        self,
        manager: KVCacheEventManager,
        on_drain: Callable[[EventDrain, float], None] | None = None,
        pause_s: float = 0.0,
    ) -> None:
        self.manager = manager
        self.got: list[KVCacheEvent] = []
        self.drops: dict[int, int] = {}
        self._on_drain = on_drain
        self._pause_s = pause_s
        self.thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> None:
        self.thread.start()

    def finished(self, timeout: float) -> bool:
        """Whether the thread ended within ``timeout`` seconds."""
        return wait_for(lambda: not self.thread.is_alive(), timeout)

    def _run(self) -> None:
        manager = self.manager
        while True:
            drain = manager.drain(timeout=0.05)
            self.got.extend(drain.events)
            for d in drain.dropped:
                self.drops[d.attention_dp_rank] = self.drops.get(d.attention_dp_rank, 0) + d.dropped_events
            if self._on_drain is not None:
                self._on_drain(drain, time.monotonic())
            if manager.buffer.closed and not drain.events and not drain.dropped:
                return
            if self._pause_s:
                time.sleep(self._pause_s)
