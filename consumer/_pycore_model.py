"""The pure-Python core's records: instances, workers, their window caches, block nodes."""

from __future__ import annotations

from ._state import LEVEL_MAX, MAX_REASONS, PRIORITY_MAX, UNKNOWN_SEQUENCE, InstanceState

MAX_RETIRED_PRODUCERS = 1024
"""Retired producer ids an instance remembers (the longest retired is forgotten past it)."""


def retire_producer(retired: dict[int, int], producer_id: int, sequence: int) -> None:
    """Retire ``producer_id`` after ``sequence`` (both cores). ``retired`` keeps retirement
    order (so does a saved state), and past ``MAX_RETIRED_PRODUCERS`` the producer retired
    longest ago is forgotten: a batch of it later is a new session, as before it was known."""
    retired[producer_id] = sequence
    if len(retired) > MAX_RETIRED_PRODUCERS:
        del retired[next(iter(retired))]


def retired_of(state: InstanceState) -> dict[int, int]:
    """A restored instance's retired producers and the last sequence seen from each."""
    sequences = state.retired_sequences or [UNKNOWN_SEQUENCE] * len(state.retired)
    if len(sequences) != len(state.retired):
        raise ValueError(
            f"corrupt index state: instance {state.instance_id!r} has retired producers without sequences"
        )
    return dict(zip(state.retired, sequences, strict=True))


def add_pending(pending: list[tuple[str, int]], reason: str, below: int) -> None:
    """Keep ``reason`` for every rank below ``below`` not seen yet (both cores). At most
    MAX_REASONS are kept, as a worker keeps its reasons: past that only a degradation covering
    more ranks than any kept, in place of the last, so that every rank one ever covered is still
    degraded when it comes (each gap of a producer that never sends its other ranks used to add
    one, without bound, to memory and to every checkpoint)."""
    if len(pending) < MAX_REASONS:
        pending.append((reason, below))
    elif below > max(b for _, b in pending):
        pending[-1] = (reason, below)


def clamp_level(value: int) -> int:
    """A cache level in the range the index keeps (0..LEVEL_MAX)."""
    return LEVEL_MAX if value > LEVEL_MAX else (0 if value < 0 else value)


def clamp_priority(value: int) -> int:
    """A retention priority in the range the index keeps (0..PRIORITY_MAX)."""
    return PRIORITY_MAX if value > PRIORITY_MAX else (0 if value < 0 else value)


class Slot:
    """One (worker, window size) cache."""

    __slots__ = ("active", "capacity", "held", "levels", "window", "worker")

    def __init__(self, worker: Worker, window: int) -> None:
        self.worker = worker
        self.window = window
        self.active = True
        self.capacity: list[int] | None = None
        self.levels = [0] * (LEVEL_MAX + 1)
        self.held: set[int] = set()  # engine hashes of the nodes it holds (a restart clears these)


class Worker:
    __slots__ = (
        "cursor",
        "gaps",
        "instance",
        "last_created",
        "rank",
        "reasons",
        "session_fresh",
        "slots",
        "split_blocks",
        "split_tail",
    )

    def __init__(self, instance: Instance, rank: int) -> None:
        self.instance = instance
        self.rank = rank
        self.cursor: int | None = None
        self.last_created = False
        self.session_fresh = True
        self.split_blocks = 0
        self.split_tail: int | None = None
        self.reasons: list[str] = []
        self.gaps = 0
        self.slots: dict[int, int] = {}  # window size -> slot id (active or not)


class Instance:
    __slots__ = ("dp_size", "instance_id", "pending", "producer_id", "retired", "sequence", "workers")

    def __init__(self, instance_id: str) -> None:
        self.instance_id = instance_id
        self.producer_id: int | None = None
        self.sequence = 0
        self.retired: dict[int, int] = {}  # producer id -> the last sequence seen from it
        self.dp_size = 1
        self.workers: dict[int, Worker] = {}
        self.pending: list[tuple[str, int]] = []  # (reason, n): every rank < n not seen yet


class Node:
    """One engine block hash: its content hash (None for an orphan) and holders."""

    __slots__ = ("content", "holders")

    def __init__(self) -> None:
        self.content: int | None = None
        self.holders: dict[int, list[int]] = {}  # slot -> [level, priority]
