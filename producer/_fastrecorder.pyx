# cython: language_level=3, boundscheck=False, wraparound=False
"""Compiled twin of ``kvevents.producer._recorder.PyRecorder``: the engine thread's
``enqueue_*`` / ``flush`` path, same records, same checks, same errors.

The engine calls these after sleeping through a GPU step, with cold caches: a call here runs no
bytecode and builds no frame, so it touches far less code and memory than the Python method.
Every unusual argument (a numpy integer, a bad value) takes the pure-Python slow path, so the
error messages are the same.
"""

from cpython.long cimport PyLong_AsLongLongAndOverflow

from kvevents.schemas import KVCacheCreatedData, KVCacheUpdatedData

from kvevents.producer._recorder import bad_block, bad_update, check_block_hash, check_levels, check_window
from kvevents.producer.block import BlockInfo

cdef object _BlockInfo = BlockInfo
cdef object _Created = KVCacheCreatedData
cdef object _Updated = KVCacheUpdatedData
cdef long long _I32_MAX = (1 << 31) - 1
cdef object _U64_MAX = (1 << 64) - 1


cdef inline bint _is_window(object window_size):
    cdef int overflow = 0
    cdef long long value
    if type(window_size) is not int:
        return False
    value = PyLong_AsLongLongAndOverflow(window_size, &overflow)
    return overflow == 0 and 0 < value <= _I32_MAX


cdef inline bint _is_hash(object block_hash):
    cdef int overflow = 0
    cdef long long value
    if type(block_hash) is not int:
        return False
    value = PyLong_AsLongLongAndOverflow(block_hash, &overflow)
    if overflow == 0:
        return value >= 0
    return overflow > 0 and block_hash <= _U64_MAX


cdef class Recorder:
    """See ``PyRecorder``: the same attributes, methods and records."""

    cdef public object pending
    cdef public object worker
    cdef public bint closed
    cdef public list queue
    cdef public long long next_id
    cdef public long long iterations_flushed
    # The window of the last queued record while it is a Removed one, else 0 (no window), and
    # its hashes once a second one merged into it.
    cdef long long _removed_window
    cdef list _removed_hashes
    cdef object _append_pending

    def __init__(self, pending, worker):
        self.pending = pending
        self._append_pending = pending.append
        self.worker = worker
        self.closed = False
        self.queue = []
        self.next_id = 0
        self._removed_window = 0
        self._removed_hashes = None
        self.iterations_flushed = 0

    cpdef end_removed_run(self):
        """The next Removed event starts a new record (something else was queued)."""
        self._removed_window = 0

    cdef inline void _record(self, object window_size, object payload):
        cdef list queue = self.queue
        queue.append(window_size)
        queue.append(payload)
        self.next_id += 1
        self._removed_window = 0

    def enqueue_created_event(self, num_blocks_per_cache_level, window_size):
        if not _is_window(window_size):
            window_size = check_window(window_size)
        cdef list levels = list(num_blocks_per_cache_level)  # a copy, as the C++ takes it by value
        check_levels(levels)
        self._record(window_size, _Created(levels))

    def enqueue_stored_event(self, blocks, window_size):
        cdef object payload
        cdef bint single = type(blocks) is list and len(<list>blocks) == 1  # the common case
        if single:
            payload = (<list>blocks)[0]
        else:
            payload = tuple(blocks)  # the engine may reuse its list; BlockInfos are immutable
            if not payload:
                return
        if not _is_window(window_size):
            window_size = check_window(window_size)
        if single:
            if type(payload) is not _BlockInfo:
                raise bad_block(payload)
        else:
            for block in <tuple>payload:
                if type(block) is not _BlockInfo:
                    raise bad_block(block)
            if len(<tuple>payload) == 1:
                payload = (<tuple>payload)[0]
        self._record(window_size, payload)

    def enqueue_removed_event(self, block_hash, window_size):
        cdef int overflow = 0
        cdef long long window
        cdef list queue
        cdef Py_ssize_t last
        if not _is_hash(block_hash):
            block_hash = check_block_hash(block_hash)
        if self._removed_window != 0 and (
            (type(window_size) is int
             and PyLong_AsLongLongAndOverflow(window_size, &overflow) == self._removed_window
             and overflow == 0)
            or (type(window_size) is not int and window_size == self._removed_window)
        ):  # merge into the open Removed record (an equal window of another type too, as PyRecorder)
            if self._removed_hashes is None:
                queue = self.queue
                last = len(queue) - 1
                self._removed_hashes = [queue[last], block_hash]
                queue[last] = self._removed_hashes
            else:
                self._removed_hashes.append(block_hash)
            return
        if not _is_window(window_size):
            window_size = check_window(window_size)
        window = window_size
        self._record(window_size, block_hash)
        self._removed_window = window
        self._removed_hashes = None

    def enqueue_updated_event(self, data, window_size):
        if type(data) is not _Updated:
            raise bad_update(data)
        if not _is_window(window_size):
            window_size = check_window(window_size)
        self._record(window_size, data)

    def flush(self):
        cdef list records = self.queue
        if not records:
            return
        self.queue = []
        self._removed_window = 0
        self.iterations_flushed += 1
        self._append_pending((self.next_id - (len(records) >> 1), records))
        worker = self.worker
        if worker.parked:
            worker.wake()
        # Ordering against close(): see PyRecorder.flush.
        if self.closed and not worker.thread.is_alive():
            worker.drop_leftovers()
