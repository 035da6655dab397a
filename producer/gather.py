"""The attention-data-parallel gather: every rank's events move to rank 0 over MPI.

Ranks != 0 send their buffered events as Avro batches, point to point and non-blocking; rank 0
merges them into its own buffer (oldest dropped first, counted per rank), from where readers and
the Kafka sink take them. Protocol, shutdown, dead ranks and MPICH's behaviour when a process
dies: ``docs/GATHER_PROTOCOL.md``.
"""

from __future__ import annotations

import atexit
import logging
import threading
import weakref
from collections import deque
from collections.abc import Callable
from typing import Any

from ._gather_collector import CollectorRole, Peer
from ._gather_config import Counters, GatherConfig, GatherStats
from ._gather_sender import SenderRole
from ._gather_wire import Tag
from ._mpi import import_mpi, split_gather_communicator, tolerate_peer_failures
from .buffer import EventBuffer

__all__ = ["AttentionDpGather", "GatherConfig", "GatherStats", "Tag", "tolerate_peer_failures"]

log = logging.getLogger(__name__)

_RUNNING: weakref.WeakSet[AttentionDpGather] = weakref.WeakSet()
_ATEXIT_LOCK = threading.Lock()
_atexit_registered = False


def _stop_all_at_exit() -> None:
    """Let every running gather finish its final exchange before mpi4py finalizes MPI."""
    for gather in list(_RUNNING):
        gather.close()


class AttentionDpGather(SenderRole, CollectorRole):
    """One rank's side of the gather (the protocol: ``docs/GATHER_PROTOCOL.md``).

    Built by the manager: ``buffer`` is the manager's buffer, the other arguments its
    configuration; ``settle`` returns the manager's ``settle`` (or None once the manager is
    gone: a weak reference, so a dropped manager can still be collected). The constructor is
    collective over ``comm`` (it splits the gather's communicator); :meth:`start` starts the
    gather's thread. The two roles' loops: :class:`~._gather_sender.SenderRole` (ranks != 0)
    and :class:`~._gather_collector.CollectorRole` (rank 0).
    """

    def __init__(
        self,
        buffer: EventBuffer,
        attention_dp_rank: int,
        attention_dp_size: int,
        gather_period_ms: float,
        comm: Any = None,
        config: GatherConfig | None = None,
        settle: Callable[[], Callable[[float | None], bool] | None] | None = None,
        on_resync: Callable[[], Callable[[int, int | None], None] | None] | None = None,
    ) -> None:
        config = GatherConfig() if config is None else config
        if not isinstance(config, GatherConfig):
            raise TypeError(f"gather_config must be a GatherConfig, got {config!r}")
        period_s = gather_period_ms / 1000.0
        if config.heartbeat_timeout_s <= 2 * period_s:
            raise ValueError(
                f"heartbeat_timeout_s ({config.heartbeat_timeout_s}) must be more than twice the gather "
                f"period ({period_s} s)"
            )
        self._mpi = mpi = import_mpi()
        parent = mpi.COMM_WORLD if comm is None else comm
        self._comm = split_gather_communicator(mpi, parent, attention_dp_rank, attention_dp_size)
        self._buffer = buffer
        self._settle = settle
        self._on_resync = on_resync
        self._resync_requests: deque[tuple[int, int, int | None]] = deque()  # any thread appends
        self._rank = attention_dp_rank
        self._size = attention_dp_size
        self._period_s = period_s
        self._config = config
        self._instance_id = f"attention-dp-rank-{attention_dp_rank}"
        self._counters = Counters()
        self._state = "running"
        self._stop_reason: str | None = None
        self._stop_requested = False
        self._in_flight: deque[tuple[Any, bytes]] = deque()
        self._next_sequence = 0
        self._peers: dict[int, Peer] = {}
        target = self._run_collector if attention_dp_rank == 0 else self._run_sender
        self._thread = threading.Thread(
            target=self._guarded, args=(target,), name=f"kvevents-dp-gather-{attention_dp_rank}", daemon=True
        )

    # -- public ----------------------------------------------------------------------------

    @property
    def attention_dp_rank(self) -> int:
        """This rank."""
        return self._rank

    @property
    def config(self) -> GatherConfig:
        """The tuning this gather runs with."""
        return self._config

    @property
    def communicator(self) -> Any:
        """The gather's own communicator (from ``Split``); do not send on it."""
        return self._comm

    @property
    def running(self) -> bool:
        """Whether the gather's thread is alive."""
        return self._thread.is_alive()

    def start(self) -> None:
        """Start the gather's thread (once)."""
        global _atexit_registered
        with _ATEXIT_LOCK:
            if not _atexit_registered:
                # Registered after mpi4py.MPI was imported: runs before its MPI_Finalize.
                atexit.register(_stop_all_at_exit)
                _atexit_registered = True
        _RUNNING.add(self)
        self._thread.start()

    def request_stop(self) -> None:
        """Start the final exchange without waiting for it (see :meth:`close`). The gather's
        thread notices within a period (within 0.1 s when idle)."""
        self._stop_requested = True

    def join(self, timeout: float | None = None) -> bool:
        """Wait until the gather has stopped (however it was stopped); False on timeout."""
        if self._thread.ident is None:
            return True
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def close(self, timeout: float | None = None) -> bool:
        """Stop the gather and wait for its final exchange (rank != 0: send the last events,
        wait for rank 0's acknowledgement; rank 0: stop every rank and merge their last events).
        Waits at most ``timeout`` seconds (default ``shutdown_timeout_s`` + 1); returns whether
        the gather has stopped. Idempotent; never raises."""
        self.request_stop()
        if timeout is None:
            timeout = self._config.shutdown_timeout_s + 1.0
        stopped = self.join(timeout)
        if not stopped:
            log.error("attention-DP gather of rank %d did not stop within %.1f s", self._rank, timeout)
        return stopped

    def stats(self) -> GatherStats:
        """A snapshot of the counters (see :class:`GatherStats`)."""
        c = self._counters
        peers = list(self._peers.values())
        return GatherStats(
            attention_dp_rank=self._rank,
            attention_dp_size=self._size,
            state=self._state,
            stop_reason=self._stop_reason,
            messages_sent_total=c.messages_sent,
            events_sent_total=c.events_sent,
            bytes_sent_total=c.bytes_sent,
            heartbeats_sent_total=c.heartbeats_sent,
            in_flight_messages=len(self._in_flight),
            sends_deferred_total=c.sends_deferred,
            messages_received_total=c.messages_received,
            events_received_total=c.events_received,
            bytes_received_total=c.bytes_received,
            heartbeats_received_total=c.heartbeats_received,
            messages_rejected_total=c.messages_rejected,
            sequence_errors_total=c.sequence_errors,
            ranks_left=tuple(p.rank for p in peers if p.state == "left"),
            ranks_dead=tuple(p.rank for p in peers if p.state == "dead"),
            dead_rank_detections_total=c.dead_rank_detections,
            resyncs_sent_total=c.resyncs_sent,
            resyncs_received_total=c.resyncs_received,
        )

    def request_resync(self, source_rank: int, lost_events: int, newest_event_id: int | None) -> None:
        """Rank 0: tell rank ``source_rank`` that ``lost_events`` of its events (the newest
        ``newest_event_id``, None if unknown) were lost after they reached rank 0, so its
        engine publishes a snapshot. Thread-safe and non-blocking (the gather thread sends it;
        requests for one rank are merged); ignored on other ranks and for rank 0 itself."""
        if self._rank == 0 and 0 < source_rank < self._size and lost_events > 0:
            self._resync_requests.append((source_rank, lost_events, newest_event_id))

    # -- both roles --------------------------------------------------------------------------

    def _guarded(self, run: Any) -> None:
        try:
            run()
        except BaseException:
            self._state = "failed"
            self._stop_reason = self._stop_reason or "error (see the log)"
            log.exception("attention-DP gather of rank %d failed; it no longer moves events", self._rank)
        finally:
            _RUNNING.discard(self)
