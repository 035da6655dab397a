"""The interface both engine-path recorders implement, and the check that both do (mypy).

``_recorder.PyRecorder`` and the compiled ``_fastrecorder.Recorder`` (typed by
``_fastrecorder.pyi``, which ``make lint`` checks against the built module with mypy's
stubtest) record the same events, with the same checks and errors; the manager binds the
engine's ``enqueue_*`` and ``flush`` calls straight to one of them.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, Protocol

from kvevents.schemas import KVCacheUpdatedData

from ._recorder import PyRecorder
from .block import BlockInfo

__all__ = ["PURE_RECORDER", "EngineRecorder", "RecorderFactory"]


class EngineRecorder(Protocol):
    """The engine thread's state: the manager's worker deque and worker, the records since the
    last flush, the next event id (see :class:`~._recorder.PyRecorder`)."""

    pending: deque[object]
    worker: Any
    closed: bool
    queue: list[Any]
    next_id: int
    iterations_flushed: int

    def end_removed_run(self) -> None: ...
    def enqueue_created_event(self, num_blocks_per_cache_level: Iterable[int], window_size: int) -> None: ...
    def enqueue_stored_event(self, blocks: Iterable[BlockInfo], window_size: int) -> None: ...
    def enqueue_removed_event(self, block_hash: int, window_size: int) -> None: ...
    def enqueue_updated_event(self, data: KVCacheUpdatedData, window_size: int) -> None: ...
    def flush(self) -> None: ...


RecorderFactory = Callable[[deque[object], Any], EngineRecorder]
"""A recorder class: called with the manager's pending deque and its worker."""

PURE_RECORDER: RecorderFactory = PyRecorder
"""The pure-Python recorder, declared to implement :class:`EngineRecorder` (mypy checks it)."""

if TYPE_CHECKING:
    from ._fastrecorder import Recorder

    COMPILED_RECORDER: RecorderFactory = Recorder
