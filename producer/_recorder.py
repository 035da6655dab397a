"""The engine thread's path of ``KVCacheEventManager``: ``enqueue_*`` and ``flush``.

A recorder only records the window size and a reference to each event's payload in one flat
list, and ``flush()`` appends it, with the first event id, to the worker's deque: no lock, no
system call. :class:`PyRecorder` is the pure-Python twin of the compiled
``_fastrecorder.Recorder``; :func:`recorder_class` picks one (``KVEVENTS_PURE_PYTHON=1`` forces
this one). Their shared interface: :class:`~._twins.EngineRecorder`.
"""

from __future__ import annotations

import logging
import operator
from collections import deque
from typing import TYPE_CHECKING, Any

from kvevents.schemas import KVCacheCreatedData, KVCacheUpdatedData
from kvevents.schemas.codec import pure_python_forced

from kvevents._brief import brief

from .block import U64_MAX, BlockInfo

if TYPE_CHECKING:
    from ._twins import RecorderFactory

__all__ = ["I32_MAX", "PyRecorder", "check_block_hash", "check_window", "recorder_class"]

log = logging.getLogger(__name__)

I32_MAX = (1 << 31) - 1
"""Largest window size (``SizeType32`` in the C++)."""


class _NoWindow:
    """Compares unequal to every window size: no Removed event is open for merging."""

    __slots__ = ()


NO_WINDOW: Any = _NoWindow()


def check_window(window_size: object) -> int:
    """Slow path of the window check: accept integer-like values, reject the rest."""
    if isinstance(window_size, bool):
        raise TypeError(f"window_size must be an int, got {brief(window_size)}")
    try:
        value = operator.index(window_size)  # type: ignore[arg-type]
    except TypeError:
        raise TypeError(f"window_size must be an int, got {brief(window_size)}") from None
    if not 0 < value <= I32_MAX:
        raise ValueError(f"window_size must be in 1..{I32_MAX}, got {brief(value)}")
    return value


def check_block_hash(block_hash: object) -> int:
    """Slow path of the hash check: accept integer-like values (numpy), reject the rest."""
    if isinstance(block_hash, bool):
        raise TypeError(f"block_hash must be an int, got {brief(block_hash)}")
    try:
        value = operator.index(block_hash)  # type: ignore[arg-type]
    except TypeError:
        raise TypeError(f"block_hash must be an int, got {brief(block_hash)}") from None
    if not 0 <= value <= U64_MAX:
        raise ValueError(f"block_hash must be an unsigned 64-bit int, got {brief(value)}")
    return value


def check_levels(levels: list[Any]) -> None:
    """A Created event's blocks per cache level: ints in 0..2**31-1 (the schema's int)."""
    for n in levels:
        if n.__class__ is not int or not 0 <= n <= I32_MAX:
            raise ValueError(f"num_blocks_per_cache_level must hold ints in 0..{I32_MAX}, got {brief(n)}")


def bad_block(block: object) -> TypeError:
    return TypeError(f"enqueue_stored_event takes BlockInfo objects, got {brief(block)}")


def bad_update(data: object) -> TypeError:
    return TypeError(f"enqueue_updated_event takes a KVCacheUpdatedData, got {brief(data)}")


class PyRecorder:
    """The engine thread's state and calls (``mEventQueue`` / ``mEventId`` in the C++: no lock).

    ``pending`` and ``worker`` are the manager's worker's deque and worker; ``closed`` is set by
    the manager's ``close()``. ``queue`` holds the records since the last flush, flat:
    ``[window_size, payload, window_size, payload, ...]`` (the ids are consecutive and end at
    ``next_id - 1``, so none is stored; see :mod:`._worker` for the payloads). ``flush()`` hands
    ``(first_id, queue)`` to the worker. :meth:`end_removed_run` stops merging Removed hashes
    into the last record.
    """

    __slots__ = (
        "closed",
        "iterations_flushed",
        "next_id",
        "pending",
        "queue",
        "removed_hashes",
        "removed_window",
        "worker",
    )

    def __init__(self, pending: deque[object], worker: Any) -> None:
        self.pending = pending
        self.worker = worker
        self.closed = False
        self.queue: list[Any] = []
        self.next_id = 0
        self.removed_window: Any = NO_WINDOW  # window of the last queued record while it is Removed
        self.removed_hashes: list[int] | None = None  # ... and its hashes once a second one merged
        self.iterations_flushed = 0

    def end_removed_run(self) -> None:
        """The next Removed event starts a new record (something else was queued)."""
        self.removed_window = NO_WINDOW

    def enqueue_created_event(self, num_blocks_per_cache_level: Any, window_size: int) -> None:
        if window_size.__class__ is not int or not 0 < window_size <= I32_MAX:
            window_size = check_window(window_size)
        levels = list(num_blocks_per_cache_level)  # a copy, as the C++ takes the vector by value
        check_levels(levels)
        self.queue += (window_size, KVCacheCreatedData(levels))
        self.next_id += 1
        self.removed_window = NO_WINDOW

    def enqueue_stored_event(self, blocks: Any, window_size: int) -> None:
        blocks = tuple(blocks)  # the engine may reuse its list; BlockInfos are immutable
        if not blocks:
            return
        if window_size.__class__ is not int or not 0 < window_size <= I32_MAX:
            window_size = check_window(window_size)
        for block in blocks:
            if block.__class__ is not BlockInfo:
                raise bad_block(block)
        self.queue += (window_size, blocks[0] if len(blocks) == 1 else blocks)
        self.next_id += 1
        self.removed_window = NO_WINDOW

    def enqueue_removed_event(self, block_hash: int, window_size: int) -> None:
        if block_hash.__class__ is not int or not 0 <= block_hash <= U64_MAX:
            block_hash = check_block_hash(block_hash)
        # removed_window is a (checked) window only while the last queued record is Removed.
        if window_size == self.removed_window:
            if self.removed_hashes is None:  # the record's payload becomes a list of hashes
                self.removed_hashes = self.queue[-1] = [self.queue[-1], block_hash]
            else:
                self.removed_hashes.append(block_hash)
            return
        if window_size.__class__ is not int or not 0 < window_size <= I32_MAX:
            window_size = check_window(window_size)
        self.queue += (window_size, block_hash)
        self.next_id += 1
        self.removed_window = window_size
        self.removed_hashes = None

    def enqueue_updated_event(self, data: KVCacheUpdatedData, window_size: int) -> None:
        if data.__class__ is not KVCacheUpdatedData:
            raise bad_update(data)
        if window_size.__class__ is not int or not 0 < window_size <= I32_MAX:
            window_size = check_window(window_size)
        self.queue += (window_size, data)
        self.next_id += 1
        self.removed_window = NO_WINDOW

    def flush(self) -> None:
        records = self.queue
        if not records:
            return
        self.queue = []
        self.removed_window = NO_WINDOW
        self.iterations_flushed += 1
        self.pending.append((self.next_id - (len(records) >> 1), records))
        worker = self.worker
        if worker.parked:
            worker.wake()
        # Ordering against close() without a lock: close() sets closed before it stops the
        # worker and drops what is left behind STOP. Reading closed False here means the
        # append came first, so close() sees the records; reading True, whatever the worker
        # will not buffer any more is dropped (counted) by whoever takes it first.
        if self.closed and not worker.thread.is_alive():
            worker.drop_leftovers()


def recorder_class() -> RecorderFactory:
    """The compiled recorder when it is built, unless ``KVEVENTS_PURE_PYTHON`` is set."""
    if pure_python_forced():
        return PyRecorder
    try:
        from ._fastrecorder import Recorder
    except ImportError:
        log.debug("kvevents.producer._fastrecorder is not built; using the pure-Python recorder")
        return PyRecorder
    return Recorder  # mypy checks the stub (_fastrecorder.pyi) against EngineRecorder here
