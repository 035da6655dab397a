"""The attention-data-parallel gather: every rank's events move to rank 0 over MPI.

Ranks != 0 send their buffered events as Avro batches, point to point and non-blocking; rank 0
merges them into its own buffer (oldest dropped first, counted per rank), from where readers and
the Kafka sink take them. Protocol, shutdown, dead ranks and MPICH's behaviour when a process
dies: ``docs/GATHER_PROTOCOL.md``.
"""

from __future__ import annotations

import atexit
import logging
import math
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvevents.schemas import EventBatch

from ._gather_wire import (
    ProtocolError,
    Tag,
    check_batch,
    chunk_batches,
    decode_resync,
    encode_resync,
    read_batch,
)
from ._mpi import import_mpi, split_gather_communicator, tolerate_peer_failures
from .buffer import EventBuffer, EventDrain

__all__ = ["AttentionDpGather", "GatherConfig", "GatherStats", "Tag", "tolerate_peer_failures"]

log = logging.getLogger(__name__)

_IDLE_AFTER_S = 1.0
"""Rank 0 polls every ``poll_interval_s`` until no events came for this long, ..."""
_IDLE_POLL_S = 0.05
"""... then every this long (a wake costs 25-100 us of CPU on a small VM: next to nothing idle)."""
_PROBE_MISSES = 4
"""An ``Improbe`` that finds nothing is retried until this many miss in a row: one MPICH
progress call can handle one incoming item that is not a match (measured here: stopping at the
first miss left messages of 3 busy ranks waiting ~100 ms; four misses in a row, ~0.6 ms)."""
_MAX_SILENCE_STEP_S = 0.2
"""Rank 0 counts a peer's silence only while it listens: one pass of its loop adds at most this
much (it normally adds one poll interval, up to 50 ms)."""
_IDLE_WAIT_S = 0.1
"""A rank != 0 with nothing to send waits on its buffer this long at a time (then checks MPI)."""


def _positive(name: str, value: object) -> None:
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not math.isfinite(value)
        or value <= 0
    ):
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")


@dataclass(frozen=True, slots=True)
class GatherConfig:
    """Tuning of the attention-DP gather (the period is the manager's
    ``attention_dp_events_gather_period_ms``).

    - ``heartbeat_interval_s``: an idle rank != 0 sends an empty HEARTBEAT this often.
    - ``heartbeat_timeout_s``: rank 0 declares a rank dead after hearing nothing from it for
      this long (the bound on dead-rank detection); more than twice the heartbeat interval and
      twice the period.
    - ``shutdown_timeout_s``: the longest a final exchange waits (rank r for BYE_ACK, rank 0
      for the BYEs).
    - ``max_in_flight``: a rank != 0 drains its buffer only while fewer messages than this are
      in flight (a batch of n events is ``ceil(n / max_events_per_message)`` messages, so at
      most ``max_in_flight - 1 + ceil(capacity / max_events_per_message)`` are in flight).
    - ``max_events_per_message``: events per MPI message (bounds the time rank 0 holds the GIL
      decoding one message: about 0.5 us per event).
    - ``poll_interval_s``: how often rank 0 looks for messages while events flow (at most a
      quarter period; every 50 ms after a second without events).
    """

    heartbeat_interval_s: float = 0.5
    heartbeat_timeout_s: float = 5.0
    shutdown_timeout_s: float = 5.0
    max_in_flight: int = 8
    max_events_per_message: int = 1024
    poll_interval_s: float = 0.001

    def __post_init__(self) -> None:
        for name in ("heartbeat_interval_s", "heartbeat_timeout_s", "shutdown_timeout_s", "poll_interval_s"):
            _positive(name, getattr(self, name))
        for name in ("max_in_flight", "max_events_per_message"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if self.heartbeat_timeout_s <= 2 * self.heartbeat_interval_s:
            raise ValueError(
                f"heartbeat_timeout_s ({self.heartbeat_timeout_s}) must be more than twice "
                f"heartbeat_interval_s ({self.heartbeat_interval_s})"
            )


@dataclass(frozen=True, slots=True)
class GatherStats:
    """A snapshot of one rank's gather. Counters end in ``_total``; fields of the other role
    stay 0 (rank 0 sends only control messages; ranks != 0 receive only control messages).

    - ``state``: ``running``, ``stopping``, ``stopped`` or ``failed``; ``stop_reason`` says why
      it stopped (None while running).
    - Sending (ranks != 0): ``messages_sent_total`` (EVENTS and BYE), ``events_sent_total``,
      ``bytes_sent_total``, ``heartbeats_sent_total``, ``in_flight_messages`` now, and
      ``sends_deferred_total``: how often the sender left events in its buffer for another
      half period because ``max_in_flight`` messages were still pending.
    - Receiving (rank 0): ``messages_received_total``, ``events_received_total``,
      ``bytes_received_total``, ``heartbeats_received_total``, ``messages_rejected_total``
      (bytes that did not decode or broke the rules; counted as drops of their rank),
      ``sequence_errors_total`` (a batch number out of order: a bug, never expected).
    - Peers (rank 0): ``ranks_left`` (said BYE), ``ranks_dead`` (declared dead and not back),
      ``dead_rank_detections_total``.
    """

    attention_dp_rank: int
    attention_dp_size: int
    state: str
    stop_reason: str | None
    messages_sent_total: int
    events_sent_total: int
    bytes_sent_total: int
    heartbeats_sent_total: int
    in_flight_messages: int
    sends_deferred_total: int
    messages_received_total: int
    events_received_total: int
    bytes_received_total: int
    heartbeats_received_total: int
    messages_rejected_total: int
    sequence_errors_total: int
    ranks_left: tuple[int, ...]
    ranks_dead: tuple[int, ...]
    dead_rank_detections_total: int
    resyncs_sent_total: int = 0
    """Rank 0: RESYNC messages sent (losses of a rank's events after they left it)."""
    resyncs_received_total: int = 0
    """Rank r != 0: RESYNC messages received from rank 0."""


class _Counters:
    """Plain ints, each written by the gather thread only; read by ``stats()`` from any thread."""

    def __init__(self) -> None:
        self.messages_sent = 0
        self.events_sent = 0
        self.bytes_sent = 0
        self.heartbeats_sent = 0
        self.sends_deferred = 0
        self.messages_received = 0
        self.events_received = 0
        self.bytes_received = 0
        self.heartbeats_received = 0
        self.messages_rejected = 0
        self.sequence_errors = 0
        self.dead_rank_detections = 0
        self.resyncs_sent = 0
        self.resyncs_received = 0


class _Peer:
    """Rank 0's view of one rank r != 0."""

    __slots__ = ("last_event_id", "next_sequence", "pending", "rank", "resync", "silence", "state")

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.state = "live"  # live | left | dead
        self.silence = 0.0  # seconds rank 0 listened without hearing from this rank
        self.next_sequence = 0
        self.last_event_id = -1
        # Matched messages in the order MPI matched them: (tag, buffer, request or None).
        self.pending: deque[tuple[int, bytearray, Any]] = deque()
        # Losses of this rank's events at rank 0 not yet sent as RESYNC: (events, newest id).
        self.resync: tuple[int, int | None] | None = None


_RUNNING: weakref.WeakSet[AttentionDpGather] = weakref.WeakSet()
_ATEXIT_LOCK = threading.Lock()
_atexit_registered = False


def _stop_all_at_exit() -> None:
    """Let every running gather finish its final exchange before mpi4py finalizes MPI."""
    for gather in list(_RUNNING):
        gather.close()


class AttentionDpGather:
    """One rank's side of the gather (the protocol: ``docs/GATHER_PROTOCOL.md``).

    Built by the manager: ``buffer`` is the manager's buffer, the other arguments its
    configuration; ``settle`` returns the manager's ``settle`` (or None once the manager is
    gone: a weak reference, so a dropped manager can still be collected). The constructor is
    collective over ``comm`` (it splits the gather's communicator); :meth:`start` starts the
    gather's thread.
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
        self._counters = _Counters()
        self._state = "running"
        self._stop_reason: str | None = None
        self._stop_requested = False
        self._in_flight: deque[tuple[Any, bytes]] = deque()
        self._next_sequence = 0
        self._peers: dict[int, _Peer] = {}
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

    def _isend(self, data: bytes, tag: Tag, dest: int) -> None:
        request = self._comm.Isend([data, self._mpi.BYTE], dest, int(tag))
        self._in_flight.append((request, data))  # keeps the bytes alive until sent

    def _test_sends(self) -> None:
        if self._in_flight:
            self._in_flight = deque(item for item in self._in_flight if not item[0].Test())

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

    # -- ranks != 0 ----------------------------------------------------------------------------

    def _run_sender(self) -> None:
        """Send what the buffer holds as soon as it holds something, at most one batch per half
        period (so an event waits at most half a period here, and the transfer and rank 0's poll
        fit in the other half); while there is nothing, sleep on the buffer (woken by the next
        events)."""
        config = self._config
        spacing = self._period_s / 2
        idle_wait = min(config.heartbeat_interval_s, _IDLE_WAIT_S)
        next_send = time.monotonic()
        last_message_at = next_send
        while True:
            delay = next_send - time.monotonic()
            if delay > 0 and not self._stop_requested:
                time.sleep(delay)  # cheaper than an Event wake; a close waits at most a period
            self._test_sends()
            if Tag.STOP in self._receive_control():
                reason = "rank 0 stopped the gather"
                break
            if self._stop_requested:
                reason = "closed on this rank"
                break
            if len(self._in_flight) >= config.max_in_flight:
                self._counters.sends_deferred += 1  # the events wait in the bounded buffer
                next_send = time.monotonic() + spacing
                continue
            drain = self._buffer.drain(timeout=idle_wait)  # at once if events are buffered
            now = time.monotonic()
            if drain.events or drain.dropped:
                self._send_drain(drain, final=False)
                next_send = now + spacing
                last_message_at = now
            elif now - last_message_at >= config.heartbeat_interval_s:
                self._isend(b"", Tag.HEARTBEAT, 0)
                self._counters.heartbeats_sent += 1
                last_message_at = now
        self._leave(reason)

    def _send_drain(self, drain: EventDrain, *, final: bool) -> None:
        events = drain.events
        messages = chunk_batches(
            events,
            drain.dropped,
            instance_id=self._instance_id,
            attention_dp_size=self._size,
            first_sequence=self._next_sequence,
            max_events=self._config.max_events_per_message,
        )
        self._next_sequence += len(messages)
        last = len(messages) - 1
        for i, data in enumerate(messages):
            self._isend(data, Tag.BYE if final and i == last else Tag.EVENTS, 0)
            self._counters.bytes_sent += len(data)
        self._counters.messages_sent += len(messages)
        self._counters.events_sent += len(events)

    def _receive_control(self) -> list[int]:
        """Receive every control message rank 0 has sent; their tags."""
        mpi = self._mpi
        status = mpi.Status()
        tags = []
        misses = 0
        while misses < _PROBE_MISSES:
            message = self._comm.Improbe(0, mpi.ANY_TAG, status)
            if message is None:
                misses += 1
                continue
            misses = 0
            size = status.Get_count(mpi.BYTE)
            data = bytearray(size)
            message.Recv([data, mpi.BYTE])
            tag = status.Get_tag()
            if tag == Tag.RESYNC:
                self._resync(data)
            elif tag not in (Tag.STOP, Tag.BYE_ACK) or size:
                log.error(
                    "attention-DP rank %d got an unexpected message from rank 0 (tag %d, %d bytes)",
                    self._rank,
                    tag,
                    size,
                )
            tags.append(tag)
        return tags

    def _resync(self, data: bytearray) -> None:
        """A RESYNC from rank 0: pass the loss to the manager (which requests a snapshot)."""
        try:
            lost, newest = decode_resync(data)
        except ProtocolError as exc:
            log.error("attention-DP rank %d got a malformed RESYNC from rank 0: %s", self._rank, exc)
            lost, newest = 1, None
        self._counters.resyncs_received += 1
        callback = self._on_resync() if self._on_resync is not None else None
        if callback is not None:
            callback(lost, newest)

    def _leave(self, reason: str) -> None:
        """The final exchange of a rank != 0: last events as BYE, then wait for BYE_ACK."""
        self._state = "stopping"
        # Everything the engine flushed before now goes with the BYE (close() has settled
        # already; after a STOP the worker may still hold the last flushed iterations).
        settle = self._settle() if self._settle is not None else None
        if settle is not None:
            settle(min(1.0, self._config.shutdown_timeout_s))
        self._send_drain(self._buffer.drain(timeout=0), final=True)
        deadline = time.monotonic() + self._config.shutdown_timeout_s
        acknowledged = False
        while True:
            self._test_sends()
            if Tag.BYE_ACK in self._receive_control():  # a STOP crossing our BYE is ignored
                acknowledged = True
            if acknowledged and not self._in_flight:
                break
            if time.monotonic() >= deadline:
                log.warning(
                    "attention-DP rank %d: rank 0 did not acknowledge its last events within %.1f s "
                    "(%d messages still in flight); they may be lost",
                    self._rank,
                    self._config.shutdown_timeout_s,
                    len(self._in_flight),
                )
                reason += "; rank 0 did not acknowledge the last events"
                break
            time.sleep(self._config.poll_interval_s)
        self._finish(reason)

    # -- rank 0 ----------------------------------------------------------------------------------

    def _run_collector(self) -> None:
        config = self._config
        now = time.monotonic()
        self._peers = peers = {rank: _Peer(rank) for rank in range(1, self._size)}
        poll = min(config.poll_interval_s, self._period_s / 4)
        idle_poll = max(poll, _IDLE_POLL_S)
        last_events = now
        last_listened = now
        deadline = None
        reason = ""
        while True:
            batches, caught_up = self._receive_all()
            now = time.monotonic()
            if batches:
                last_events = now
            if caught_up:  # liveness is judged only once every waiting message is matched
                # Silence counts only while this thread listens: a pause of rank 0 itself (a
                # stopped process, a starved thread) adds at most _MAX_SILENCE_STEP_S.
                self._check_liveness(min(now - last_listened, _MAX_SILENCE_STEP_S))
                last_listened = now
            self._test_sends()
            self._send_resyncs()
            if deadline is None and self._stop_requested:
                # A rank != 0 that closes only leaves (its BYE): the others keep sending, so
                # no open rank's later events are stranded. Only rank 0's close stops them all.
                reason = "closed on this rank"
                deadline = self._begin_stop(now)
            if deadline is not None:
                if all(p.state == "dead" or (p.state == "left" and not p.pending) for p in peers.values()):
                    break
                if now >= deadline:
                    missing = [
                        p.rank
                        for p in peers.values()
                        if p.state == "live" or (p.state == "left" and p.pending)
                    ]
                    log.warning(
                        "attention-DP gather stopping: ranks %s did not send their last events within %.1f s",
                        missing,
                        config.shutdown_timeout_s,
                    )
                    reason += f"; ranks {missing} did not finish"
                    break
            busy = deadline is not None or now - last_events < _IDLE_AFTER_S
            if not self._stop_requested or deadline is not None:
                time.sleep(poll if busy else idle_poll)
        # Our STOP / BYE_ACK messages are tiny (sent eagerly); give them a moment to complete.
        settle_until = time.monotonic() + min(1.0, config.shutdown_timeout_s)
        while self._in_flight and time.monotonic() < settle_until:
            time.sleep(poll)
            self._test_sends()
        self._finish(reason)

    def _send_resyncs(self) -> None:
        """Send the requested RESYNCs: merged per rank, to live ranks (a rank declared dead gets
        its RESYNC if it is taken back; a rank that left needs none)."""
        requests = self._resync_requests
        while requests:
            rank, lost, newest = requests.popleft()
            peer = self._peers.get(rank)
            if peer is None or peer.state == "left":
                continue
            if peer.resync is not None:
                before_lost, before_newest = peer.resync
                lost += before_lost
                newest = None if newest is None or before_newest is None else max(newest, before_newest)
            peer.resync = (lost, newest)
        for peer in self._peers.values():
            if peer.resync is not None and peer.state == "live":
                self._isend(encode_resync(*peer.resync), Tag.RESYNC, peer.rank)
                self._counters.resyncs_sent += 1
                log.warning(
                    "attention-DP rank 0 lost %d event(s) of rank %d after they left it: asked rank %d for a "
                    "snapshot",
                    peer.resync[0],
                    peer.rank,
                    peer.rank,
                )
                peer.resync = None

    def _begin_stop(self, now: float) -> float:
        self._state = "stopping"
        for peer in self._peers.values():
            if peer.state != "left":
                self._isend(b"", Tag.STOP, peer.rank)
        return now + self._config.shutdown_timeout_s

    def _receive_all(self) -> tuple[int, bool]:
        """Match waiting messages (at most a round's worth), merge every completed one in order.
        Returns (batches merged, whether no matched message was left waiting)."""
        mpi = self._mpi
        comm = self._comm
        status = mpi.Status()
        peers = self._peers
        handled = 0
        caught_up = False
        misses = 0
        for _ in range(4 * len(peers) + 16 + _PROBE_MISSES):
            message = comm.Improbe(mpi.ANY_SOURCE, mpi.ANY_TAG, status)
            if message is None:
                misses += 1
                if misses >= _PROBE_MISSES:
                    caught_up = True
                    break
                continue
            misses = 0
            peer = peers[status.Get_source()]
            size = status.Get_count(mpi.BYTE)
            buffer = bytearray(size)
            if size:
                request = message.Irecv([buffer, mpi.BYTE])
            else:
                message.Recv([buffer, mpi.BYTE])
                request = None
            peer.pending.append((status.Get_tag(), buffer, request))
            peer.silence = 0.0
            if peer.state == "dead":
                peer.state = "live"
                log.warning("attention-DP rank %d, declared dead, is sending again: taken back", peer.rank)
        for peer in peers.values():
            pending = peer.pending
            while pending:
                tag, buffer, request = pending[0]
                if request is not None and not request.Test():
                    break
                pending.popleft()
                self._handle(peer, tag, buffer)
                if tag != Tag.HEARTBEAT:
                    handled += 1
        return handled, caught_up

    def _handle(self, peer: _Peer, tag: int, data: bytearray) -> None:
        counters = self._counters
        if tag == Tag.HEARTBEAT:
            counters.heartbeats_received += 1
        elif tag == Tag.EVENTS or tag == Tag.BYE:
            counters.messages_received += 1
            counters.bytes_received += len(data)
            self._merge(peer, data)
            if tag == Tag.BYE:
                peer.state = "left"
                log.info("attention-DP rank %d closed and left the gather", peer.rank)
                self._isend(b"", Tag.BYE_ACK, peer.rank)
        else:
            counters.messages_rejected += 1
            log.error(
                "attention-DP rank %d sent a message with unknown tag %d (%d bytes)",
                peer.rank,
                tag,
                len(data),
            )

    def _merge(self, peer: _Peer, data: bytearray) -> None:
        batch: EventBatch | None = None
        try:
            batch = read_batch(data, peer.rank)
            check_batch(batch, peer.rank, self._size, peer.last_event_id)
        except ProtocolError as exc:
            lost = 1
            if batch is not None:
                lost = max(1, len(batch.events) + sum(max(0, d.dropped_events) for d in batch.dropped))
            self._counters.messages_rejected += 1
            log.error("attention-DP gather rejected a message: %s; counted as %d dropped event(s)", exc, lost)
            self._buffer.record_drops(peer.rank, lost)
            return
        if batch.sequence != peer.next_sequence:
            self._counters.sequence_errors += 1
            log.error(
                "attention-DP rank %d sent batch %d, expected %d",
                peer.rank,
                batch.sequence,
                peer.next_sequence,
            )
        peer.next_sequence = batch.sequence + 1
        for drops in batch.dropped:  # rank r counted them itself: it needs no RESYNC for them
            self._buffer.record_drops(peer.rank, drops.dropped_events, notify=False)
        events = batch.events
        if events:
            self._buffer.extend(events)
            peer.last_event_id = events[-1].event_id
            self._counters.events_received += len(events)

    def _check_liveness(self, listened: float) -> None:
        timeout = self._config.heartbeat_timeout_s
        for peer in self._peers.values():
            if peer.state != "live":
                continue
            peer.silence += listened
            if peer.silence > timeout:
                peer.state = "dead"
                self._counters.dead_rank_detections += 1
                log.error(
                    "attention-DP rank %d sent nothing for %.1f s (heartbeat timeout %.1f s): declared dead; "
                    "the events it had not sent are lost (reported in-band as 1 dropped event of rank %d); "
                    "the other ranks go on",
                    peer.rank,
                    peer.silence,
                    timeout,
                    peer.rank,
                )
                self._buffer.record_drops(peer.rank, 1)
