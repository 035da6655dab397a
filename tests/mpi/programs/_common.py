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
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvevents.producer import BlockInfo, KVCacheEventManager
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
                BlockInfo(base + b + 1, base + b if b else None, [rank, i, b] * 4) for b in range(rng.randint(1, 4))
            ]
            manager.enqueue_stored_event(blocks, WINDOW)
        elif kind < 0.75:
            manager.enqueue_removed_event(rng.getrandbits(64), WINDOW + (i % 2) + 1)
        elif kind < 0.98:
            manager.enqueue_updated_event(KVCacheUpdatedData(rng.getrandbits(64), priority=KVCacheEventDiff(35, 90)), WINDOW)
        else:
            manager.enqueue_created_event([1000, 100], WINDOW)
    manager.flush()


def ids_by_rank(events: list[KVCacheEvent]) -> dict[int, list[int]]:
    got: dict[int, list[int]] = {}
    for event in events:
        got.setdefault(event.attention_dp_rank if event.attention_dp_rank is not None else -1, []).append(event.event_id)
    return got


def fail(out: Path, rank: int, message: str) -> None:
    """Record a program failure where the test will see it, then exit non-zero."""
    write_result(out, rank, {"error": message})
    print(f"rank {rank}: {message}", file=sys.stderr, flush=True)
    sys.exit(3)
