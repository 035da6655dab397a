"""What both roles of the attention-DP gather share: the state the gather's constructor sets
and the non-blocking sends (``producer/gather.py`` builds it; ``_gather_sender.py`` and
``_gather_collector.py`` are the two roles)."""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ._gather_config import Counters, GatherConfig
from ._gather_wire import Tag
from .buffer import EventBuffer

if TYPE_CHECKING:
    from ._gather_collector import Peer

__all__ = ["PROBE_MISSES", "GatherCore"]

log = logging.getLogger("kvevents.producer.gather")

PROBE_MISSES = 4
"""An ``Improbe`` that finds nothing is retried until this many miss in a row: one MPICH
progress call can handle one incoming item that is not a match (measured here: stopping at the
first miss left messages of 3 busy ranks waiting ~100 ms; four misses in a row, ~0.6 ms)."""


class GatherCore:
    """The gather's state (set by ``AttentionDpGather.__init__``) and its sends."""

    _mpi: Any
    _comm: Any
    _buffer: EventBuffer
    _settle: Callable[[], Callable[[float | None], bool] | None] | None
    _on_resync: Callable[[], Callable[[int, int | None], None] | None] | None
    _resync_requests: deque[tuple[int, int, int | None]]
    _rank: int
    _size: int
    _period_s: float
    _config: GatherConfig
    _instance_id: str
    _counters: Counters
    _state: str
    _stop_reason: str | None
    _stop_requested: bool
    _in_flight: deque[tuple[Any, bytes]]
    _next_sequence: int
    _peers: dict[int, Peer]

    def _isend(self, data: bytes, tag: Tag, dest: int) -> None:
        request = self._comm.Isend([data, self._mpi.BYTE], dest, int(tag))
        self._in_flight.append((request, data))  # keeps the bytes alive until sent

    def _test_sends(self) -> None:
        """Drop the sends that completed (one ``Testsome`` for all: each MPI call releases the
        GIL; a completed request becomes REQUEST_NULL, which is false)."""
        if self._in_flight:
            self._mpi.Request.Testsome([request for request, _ in self._in_flight])
            self._in_flight = deque(item for item in self._in_flight if item[0])

    def _finish(self, reason: str) -> None:
        # Free the communicator only if nothing is pending on it (a dead peer can leave a
        # request that never completes: then MPI_Finalize is left to clean up).
        self._test_sends()
        pending_receives = any(p.pending for p in self._peers.values())
        if not self._in_flight and not pending_receives:
            self._comm.Free()
        self._stop_reason = reason
        self._state = "stopped"
        log.info("attention-DP gather of rank %d stopped: %s", self._rank, reason)
