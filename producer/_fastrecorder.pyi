# The interface of the compiled recorder (_fastrecorder.pyx), for mypy and editors: it must
# satisfy kvevents.producer._twins.EngineRecorder (checked there), and `make lint` runs mypy's
# stubtest to check these signatures against the built extension.
from collections import deque
from collections.abc import Iterable
from typing import Any

from kvevents.schemas import KVCacheUpdatedData
from typing_extensions import disjoint_base

from .block import BlockInfo

@disjoint_base  # a cdef class
class Recorder:
    pending: deque[object]
    worker: Any
    closed: bool
    queue: list[Any]
    next_id: int
    iterations_flushed: int
    def __init__(self, pending: deque[object], worker: Any) -> None: ...
    def end_removed_run(self) -> None: ...
    def enqueue_created_event(self, num_blocks_per_cache_level: Iterable[int], window_size: int) -> None: ...
    def enqueue_stored_event(self, blocks: Iterable[BlockInfo], window_size: int) -> None: ...
    def enqueue_removed_event(self, block_hash: int, window_size: int) -> None: ...
    def enqueue_updated_event(self, data: KVCacheUpdatedData, window_size: int) -> None: ...
    def flush(self) -> None: ...
