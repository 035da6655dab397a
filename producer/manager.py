"""``KVCacheEventManager``: one rank's KV-cache events, TensorRT-LLM's manager in Python.

The C++ original (``batch_manager/kvCacheEventManager.cpp``) is the specification, pinned by
``tests/unit/producer/test_manager_conformance.py``. The engine thread's ``enqueue_*``/``flush``
only record (:mod:`._recorder`); a background worker builds the events into the bounded
:class:`~kvevents.producer.buffer.EventBuffer` (:mod:`._worker`). Threads, the deliberate
differences from the C++, the seams for the gather and the sink, and snapshots:
``docs/ARCHITECTURE.md`` and ``docs/OPERATIONS.md``.
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Any, Self

from kvevents.schemas import KVCacheCreatedData, KVCacheEvent, KVCacheUpdatedData

from kvevents._brief import brief

from ._recorder import I32_MAX, check_window, recorder_class
from ._twins import RecorderFactory
from ._worker import Worker
from .block import BlockInfo
from .buffer import DEFAULT_DROP_WARNING_INTERVAL_S, EventBuffer, EventDrain, check_timeout
from .snapshot import SnapshotSummary, capacities_by_window, snapshot_chains
from .stats import ManagerStats

if TYPE_CHECKING:
    from .gather import AttentionDpGather, GatherConfig
    from .sink_encoded import EncodedDrain

log = logging.getLogger(__name__)

__all__ = ["I32_MAX", "KVCacheEventManager"]

_ENGINE_METHODS = (
    "enqueue_created_event",
    "enqueue_stored_event",
    "enqueue_removed_event",
    "enqueue_updated_event",
    "flush",
)
"""Bound straight to the recorder on each manager (unless a subclass overrides them)."""


def _config_int(name: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {brief(value)}")
    return value


def _stop_soon(worker: Worker, gather: AttentionDpGather | None) -> None:
    worker.stop_soon()
    if gather is not None:
        gather.request_stop()


def _weak_drop_listener(manager: KVCacheEventManager) -> Callable[[int, int, int | None], None]:
    """The manager's drop listener, holding it weakly (the buffer must not keep it alive)."""
    ref = weakref.WeakMethod(manager._on_drops)

    def listener(source_rank: int, dropped_events: int, newest_event_id: int | None) -> None:
        method = ref()
        if method is not None:
            method(source_rank, dropped_events, newest_event_id)

    return listener


class KVCacheEventManager:
    """Collects one rank's KV-cache events and buffers them for readers.

    ``max_kv_event_entries`` bounds the buffer (times ``attention_dp_size`` on attention-DP rank
    0, which gathers every rank's events); ``attention_dp_rank`` / ``attention_dp_size`` are both
    set or both None; ``attention_dp_events_gather_period_ms`` is the attention-DP gather's
    period. ``drop_warning_interval_s`` rate-limits the drop warning.

    With an attention-DP rank and a size > 1 the manager starts the gather over MPI
    (:mod:`kvevents.producer.gather`): ranks != 0 send their events to rank 0, whose buffer and
    ``get_events`` then hold every rank's events. The constructor is then collective: every
    process of ``comm`` (an mpi4py communicator; default ``MPI.COMM_WORLD``) constructs its
    manager at the same point, as in the C++ (it splits a communicator of its own from
    ``comm``). ``gather_config`` tunes heartbeats, timeouts and in-flight bounds.
    ``attention_dp_gather=False`` keeps the DP rank (stamped on events, rank 0's capacity) but
    moves nothing and needs no MPI: for tests, or when every rank publishes its own events.
    """

    _recorder_factory: RecorderFactory | None = None
    """The engine path's implementation; None: :func:`~._recorder.recorder_class` picks it (tests
    and benchmarks set ``PyRecorder`` here to run the pure-Python path beside the compiled one)."""

    def __init__(
        self,
        max_kv_event_entries: int,
        attention_dp_rank: int | None = None,
        attention_dp_size: int | None = None,
        attention_dp_events_gather_period_ms: float = 5,
        *,
        drop_warning_interval_s: float = DEFAULT_DROP_WARNING_INTERVAL_S,
        comm: Any = None,
        attention_dp_gather: bool = True,
        gather_config: GatherConfig | None = None,
    ) -> None:
        # KVCacheEventManager::KVCacheEventManager: TLLM_CHECK(mMaxSize > 0) and the DP checks.
        _config_int("max_kv_event_entries", max_kv_event_entries, 1)
        if attention_dp_rank is not None:
            if attention_dp_size is None:
                raise ValueError("If attention DP rank is set, the attention DP size must also be set")
            _config_int("attention_dp_rank", attention_dp_rank, 0)
            _config_int("attention_dp_size", attention_dp_size, 1)
            if attention_dp_rank >= attention_dp_size:
                raise ValueError(
                    "Attention DP rank must be less than attention DP size "
                    f"(rank {attention_dp_rank}, size {attention_dp_size})"
                )
        elif attention_dp_size is not None:
            raise ValueError("If attention DP rank is not set, the attention DP size must not be set")
        period = attention_dp_events_gather_period_ms
        if isinstance(period, bool) or not isinstance(period, int | float) or not period > 0:
            raise ValueError(
                f"attention_dp_events_gather_period_ms must be a number > 0, got {brief(period)}"
            )
        if not isinstance(attention_dp_gather, bool):
            raise TypeError(f"attention_dp_gather must be a bool, got {brief(attention_dp_gather)}")
        gathers = attention_dp_gather and attention_dp_size is not None and attention_dp_size > 1
        if not gathers and (comm is not None or gather_config is not None):
            raise ValueError(
                "comm and gather_config are for the attention-DP gather: they need attention_dp_rank, "
                "attention_dp_size > 1 and attention_dp_gather=True"
            )

        self._max_entries = max_kv_event_entries
        self._rank = attention_dp_rank
        self._size = attention_dp_size
        self._gather_period_ms = period
        # Rank 0 gathers the events of every rank: it needs room for all of them.
        capacity = max_kv_event_entries
        if attention_dp_rank == 0 and attention_dp_size is not None:
            capacity *= attention_dp_size
        self._buffer = EventBuffer(capacity, drop_warning_interval_s=drop_warning_interval_s)
        # Collective over comm (a Split), so before any thread starts: an error leaks nothing.
        self._gather = self._make_gather(comm, gather_config) if gathers else None

        # Snapshots: requested by drops of this rank (worker thread) or request_snapshot() (any
        # thread); enqueue_snapshot() on the engine thread clears the request.
        self._snapshot_reason: str | None = None
        self._snapshot_requests = 0
        self._snapshots_published = 0
        self._snapshot_floor = 0  # drops of events below this id are covered by the last snapshot
        self._snapshot_listeners: list[Callable[[str], None]] = []
        self._buffer.add_drop_listener(_weak_drop_listener(self))

        self._close_lock = threading.Lock()  # orders settle() against close(); flush() takes none
        self._closed = False
        self._close_callbacks: list[Callable[[], object]] = []
        self._worker = Worker(self._buffer, attention_dp_rank)
        self._pending = self._worker.pending
        # Engine-thread state (no lock, as mEventQueue / mEventId in the C++).
        factory = self._recorder_factory or recorder_class()
        self._recorder = factory(self._pending, self._worker)
        for name in _ENGINE_METHODS:
            if getattr(type(self), name) is getattr(KVCacheEventManager, name):
                setattr(self, name, getattr(self._recorder, name))
        self._worker.thread.start()
        # Stops the worker (and the gather) if the manager is dropped without close().
        self._finalizer = weakref.finalize(self, _stop_soon, self._worker, self._gather)
        if self._gather is not None:
            self._gather.start()
            self.add_close_callback(self._gather.close)

    def _make_gather(self, comm: Any, config: GatherConfig | None) -> AttentionDpGather:
        """The attention-DP gather of this rank (imports mpi4py; collective over ``comm``)."""
        from .gather import AttentionDpGather

        assert self._rank is not None and self._size is not None
        return AttentionDpGather(
            self._buffer,
            self._rank,
            self._size,
            self._gather_period_ms,
            comm,
            config,
            weakref.WeakMethod(self.settle),
            weakref.WeakMethod(self._on_resync),
        )

    # -- configuration ----------------------------------------------------------------------

    @property
    def max_kv_event_entries(self) -> int:
        """The per-rank bound given to the constructor."""
        return self._max_entries

    @property
    def capacity(self) -> int:
        """The buffer's bound: ``max_kv_event_entries``, times ``attention_dp_size`` on rank 0."""
        return self._buffer.capacity

    @property
    def attention_dp_rank(self) -> int | None:
        """This rank, stamped on every event; None without attention DP."""
        return self._rank

    @property
    def attention_dp_size(self) -> int | None:
        """How many attention-DP ranks there are; None without attention DP."""
        return self._size

    @property
    def attention_dp_events_gather_period_ms(self) -> float:
        """How often the attention-DP gather moves events to rank 0."""
        return self._gather_period_ms

    @property
    def gather(self) -> AttentionDpGather | None:
        """This rank's attention-DP gather (its ``stats()``, ``join()``), or None without one."""
        return self._gather

    @property
    def buffer(self) -> EventBuffer:
        """The bounded buffer readers take from (the attention-DP gather's seam)."""
        return self._buffer

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._closed

    @property
    def next_event_id(self) -> int:
        """The id the next enqueued event gets (= events enqueued so far; ``mEventId`` in the
        C++). Cheap: no snapshot of the counters, unlike :meth:`stats`."""
        return int(self._recorder.next_id)

    @property
    def _next_id(self) -> int:
        return int(self._recorder.next_id)

    @_next_id.setter
    def _next_id(self, value: int) -> None:
        self._recorder.next_id = value

    # -- engine thread: record only -----------------------------------------------------------

    def enqueue_created_event(self, num_blocks_per_cache_level: Iterable[int], window_size: int) -> None:
        """Queue a Created event: the cache's capacity in blocks per cache level."""
        self._recorder.enqueue_created_event(num_blocks_per_cache_level, window_size)

    def enqueue_stored_event(self, blocks: Iterable[BlockInfo], window_size: int) -> None:
        """Queue a Stored event for ``blocks`` (in sequence order; parent = first block's
        ``prev_block_hash``). No blocks: no event, no id. The blocks are referenced, not copied."""
        self._recorder.enqueue_stored_event(blocks, window_size)

    def enqueue_removed_event(self, block_hash: int, window_size: int) -> None:
        """Queue the removal of one block: merged into the last queued event when that is a
        Removed event with the same window size (no new id), else a new Removed event."""
        self._recorder.enqueue_removed_event(block_hash, window_size)

    def enqueue_updated_event(self, data: KVCacheUpdatedData, window_size: int) -> None:
        """Queue an Updated event (a block changed cache level or priority)."""
        self._recorder.enqueue_updated_event(data, window_size)

    def enqueue_snapshot(
        self,
        windows: Mapping[int, Iterable[BlockInfo]],
        num_blocks_per_cache_level: Mapping[int, Sequence[int]] | Sequence[int],
    ) -> SnapshotSummary:
        """Queue a snapshot of this rank's whole cache: a Created event with ``snapshot=True``
        for every window size, then Stored events that restore every held block, parents first.

        ``windows`` maps each window size to every block its cache holds now, in any order
        (``prev_block_hash`` links them; ``is_primary`` and ``priority`` give each block's cache
        level and priority). ``num_blocks_per_cache_level`` is the capacity of every window, or
        a mapping per window size (a window only there is re-created empty). Call it on the
        engine thread, like the other ``enqueue_*`` calls; the events go out with the next
        :meth:`flush`. Clears :attr:`snapshot_requested`.

        Cost: linear in the held blocks, on the engine thread (about 3 us per block here: 0.3 s
        for 100k blocks in random order; a snapshot runs only after a loss). Raises
        ``ValueError`` (queueing nothing) for a malformed snapshot, or one with more events than
        the buffer holds: it could never reach a consumer whole.
        """
        order: list[int] = []
        chains: dict[int, list[tuple[BlockInfo, ...]]] = {}
        for window_size, blocks in windows.items():
            if window_size.__class__ is not int or not 0 < window_size <= I32_MAX:
                window_size = check_window(window_size)
            order.append(window_size)
            chains[window_size] = snapshot_chains(blocks)
        capacities = {
            w if w.__class__ is int and 0 < w <= I32_MAX else check_window(w): levels
            for w, levels in capacities_by_window(order, num_blocks_per_cache_level).items()
        }
        stored = sum(len(c) for c in chains.values())
        events = len(capacities) + stored
        if events > self._buffer.capacity:
            raise ValueError(
                f"a snapshot of {events} events ({len(capacities)} Created, {stored} Stored) cannot fit "
                f"the event buffer (capacity {self._buffer.capacity}): raise max_kv_event_entries"
            )
        recorder = self._recorder
        first = recorder.next_id
        queue = recorder.queue
        next_id = first
        for window_size, levels in capacities.items():
            queue += (window_size, KVCacheCreatedData(levels, snapshot=True))
            next_id += 1
        block_count = 0
        for window_size in order:
            for chain in chains[window_size]:
                queue += (window_size, chain)
                next_id += 1
                block_count += len(chain)
        recorder.next_id = next_id
        recorder.end_removed_run()
        self._snapshot_floor = first
        self._snapshot_reason = None
        self._snapshots_published += 1
        return SnapshotSummary(first, next_id - 1, tuple(capacities), stored, block_count)

    @property
    def snapshot_requested(self) -> bool:
        """Whether this rank's events were lost since its latest snapshot, so consumers hold an
        incomplete view of it: the engine should call :meth:`enqueue_snapshot`. Raised by drops
        in this manager's buffer, by losses its Kafka sink reports (:meth:`report_lost_events`)
        and, on ranks != 0, by rank 0's losses of this rank's events (a RESYNC message)."""
        return self._snapshot_reason is not None

    @property
    def snapshot_request_reason(self) -> str | None:
        """Why a snapshot is requested (the first loss since the latest snapshot), or None."""
        return self._snapshot_reason

    def request_snapshot(self, reason: str) -> None:
        """Ask the engine for a snapshot: raise :attr:`snapshot_requested` and, when it was not
        raised yet, call the snapshot listeners with ``reason``. Thread-safe and non-blocking;
        the manager calls it itself when it drops events of its own rank."""
        first = self._snapshot_reason is None
        if first:
            self._snapshot_reason = reason
        self._snapshot_requests += 1
        if first:
            for listener in list(self._snapshot_listeners):
                try:
                    listener(reason)
                except Exception:  # the caller may be the manager's worker: never let it die
                    log.exception("snapshot listener %r failed", listener)

    def add_snapshot_listener(self, listener: Callable[[str], None]) -> None:
        """Call ``listener(reason)`` when a snapshot becomes requested. It runs in the thread
        that noticed the loss (usually the manager's worker, not the engine thread): it must
        be quick and must not call ``enqueue_*``; set a flag the engine loop reads instead."""
        if not callable(listener):
            raise TypeError(f"listener must be callable, got {brief(listener)}")
        self._snapshot_listeners.append(listener)

    def report_lost_events(
        self, source_rank: int, lost_events: int, newest_event_id: int | None = None, *, where: str
    ) -> None:
        """Events of attention-DP rank ``source_rank`` (0 without attention DP) were lost after
        this manager buffered them (the Kafka sink calls this; ``where`` says how). Consumers
        now hold an incomplete view of that rank, so its engine must publish a snapshot: on
        that rank, :meth:`request_snapshot` (unless ``newest_event_id`` is older than the
        latest snapshot); on rank 0 with the attention-DP gather, a RESYNC message to that
        rank, whose manager does the same. Thread-safe and non-blocking."""
        own = self._rank or 0
        if lost_events <= 0:
            return
        if source_rank == own:
            if newest_event_id is not None and newest_event_id < self._snapshot_floor:
                return  # older than the latest snapshot, which already covers them
            self.request_snapshot(f"{lost_events} events of attention-DP rank {source_rank} {where}")
        elif self._gather is not None:
            self._gather.request_resync(source_rank, lost_events, newest_event_id)

    def _on_drops(self, source_rank: int, dropped_events: int, newest_event_id: int | None) -> None:
        self.report_lost_events(
            source_rank, dropped_events, newest_event_id, where="dropped by the event buffer"
        )

    def _on_resync(self, lost_events: int, newest_event_id: int | None) -> None:
        self.report_lost_events(
            self._rank or 0,
            lost_events,
            newest_event_id,
            where="lost on attention-DP rank 0 (buffer or Kafka sink)",
        )

    def flush(self) -> None:
        """Hand this iteration's queued events to the background worker; no-op when none.
        Never waits for the worker or any reader, and takes no lock. After :meth:`close` the
        events are dropped (and counted)."""
        self._recorder.flush()

    # -- readers --------------------------------------------------------------------------

    def get_events(self, timeout: float | None = None) -> list[KVCacheEvent]:
        """Wait until events are buffered or the manager is closed (at most ``timeout`` seconds;
        None waits forever), then return all buffered events, oldest first, and clear the buffer.
        Returns ``[]`` when the timeout passes first. On attention-DP rank 0 these are every
        rank's events (each carries its ``attention_dp_rank``)."""
        return self._buffer.take(timeout)

    def drain(self, timeout: float | None = None) -> EventDrain:
        """Like :meth:`get_events`, and atomically also take the per-source-rank counts of events
        dropped since the previous drain (the Kafka sink's seam: report the loss in-band).
        Returns when events or drops are pending, the manager is closed, or the timeout passed."""
        return self._buffer.drain(timeout)

    def drain_encoded(self, timeout: float | None = None) -> EventDrain | EncodedDrain:
        """:meth:`drain` for the Kafka sink: on attention-DP rank 0, the other ranks' events
        stay the Avro bytes the gather received, and when some are drained every event comes
        encoded (``EncodedEvents``, in buffer order), which the sink splices into its messages
        without decoding them (``docs/GATHER_PROTOCOL.md``, pass-through); else as :meth:`drain`."""
        return self._buffer.drain_encoded(timeout)

    def settle(self, timeout: float | None = None) -> bool:
        """Wait until every iteration flushed before this call is in the buffer (or dropped and
        counted). Returns False if ``timeout`` seconds passed first. Not for the engine thread."""
        timeout = check_timeout(timeout)
        marker = threading.Event()
        with self._close_lock:
            closed = self._closed
            if not closed:
                self._pending.append(marker)  # before STOP: the worker sets it
                self._worker.wake(now=True)
        if closed:
            self._worker.thread.join(timeout)
            return not self._worker.thread.is_alive()
        return marker.wait(timeout)

    # -- lifecycle ------------------------------------------------------------------------

    def add_close_callback(self, callback: Callable[[], object]) -> None:
        """Call ``callback()`` during :meth:`close`, after the worker has buffered its last
        events and before waiting readers are woken (for the attention-DP gather to stop and
        merge its last exchange). Callbacks run in the order they were added."""
        if not callable(callback):
            raise TypeError(f"callback must be callable, got {brief(callback)}")
        self._close_callbacks.append(callback)

    def close(self) -> None:
        """Flush what is still queued, let the worker buffer every flushed iteration and stop,
        run the close callbacks, then wake every reader (``get_events`` returns at once from now
        on; buffered events stay readable). Idempotent; also the context manager's exit.

        Like the C++ destructor, ``close()`` belongs to the engine side: call it from the engine
        thread, or once the engine has stopped calling ``enqueue_*``/``flush`` (readers in other
        threads are fine). A ``flush()`` after ``close()`` counts its events as dropped."""
        with self._close_lock:
            if self._closed:
                return
            self.flush()  # what the engine queued since its last flush() is not lost
            self._closed = True
            self._recorder.closed = True
            self._worker.stop_soon()
        self._finalizer.detach()
        self._worker.thread.join()
        self._worker.drop_leftovers()  # iterations flushed after close() (behind STOP)
        try:
            for callback in self._close_callbacks:
                callback()
        finally:
            self._buffer.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    # -- counters -------------------------------------------------------------------------

    def stats(self) -> ManagerStats:
        """A snapshot of the counters (see :class:`~kvevents.producer.stats.ManagerStats`)."""
        worker = self._worker
        return ManagerStats(
            events_enqueued_total=self._recorder.next_id,
            iterations_flushed_total=self._recorder.iterations_flushed,
            pending_iterations=self._recorder.iterations_flushed - worker.iterations_processed,
            events_flushed_by_type=dict(worker.events_by_type),
            stored_blocks_total=worker.stored_blocks,
            removed_block_hashes_total=worker.removed_hashes,
            buffer=self._buffer.stats(),
            snapshots_published_total=self._snapshots_published,
            snapshot_requests_total=self._snapshot_requests,
            snapshot_requested=self._snapshot_reason is not None,
        )
