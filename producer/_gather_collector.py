"""The attention-DP gather on rank 0: match every rank's messages, merge their events into
rank 0's buffer in order, send RESYNCs, notice dead ranks, stop everyone
(``docs/GATHER_PROTOCOL.md``)."""

from __future__ import annotations

import time
from collections import deque
from typing import Any

from kvevents.schemas import EventBatch

from ._gather_core import PROBE_MISSES, GatherCore, log
from ._gather_wire import (
    EncodedBatch,
    ProtocolError,
    Tag,
    check_batch,
    check_encoded,
    encode_resync,
    read_batch,
    read_encoded,
)

__all__ = ["CollectorRole", "Peer"]

_IDLE_AFTER_S = 1.0
"""Rank 0 polls every ``poll_interval_s`` until no events came for this long, ..."""
_IDLE_POLL_S = 0.05
"""... then every this long (a wake costs 25-100 us of CPU on a small VM: next to nothing idle)."""
_MAX_SILENCE_STEP_S = 0.2
"""Rank 0 counts a peer's silence only while it listens: one pass of its loop adds at most this
much (it normally adds one poll interval, up to 50 ms)."""


class Peer:
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


class CollectorRole(GatherCore):
    """The loop of rank 0 (``AttentionDpGather`` runs it on its thread)."""

    def _run_collector(self) -> None:
        config = self._config
        now = time.monotonic()
        self._peers = peers = {rank: Peer(rank) for rank in range(1, self._size)}
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
        for _ in range(4 * len(peers) + 16 + PROBE_MISSES):
            message = comm.Improbe(mpi.ANY_SOURCE, mpi.ANY_TAG, status)
            if message is None:
                misses += 1
                if misses >= PROBE_MISSES:
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
        # One Testsome for every pending receive (each MPI call releases the GIL, and on a busy
        # rank 0 getting it back can take a switch interval): what completed becomes
        # REQUEST_NULL, which is false.
        waiting = [request for peer in peers.values() for _, _, request in peer.pending if request]
        if waiting:
            mpi.Request.Testsome(waiting)
        for peer in peers.values():
            pending = peer.pending
            while pending:
                tag, buffer, request = pending[0]
                if request:
                    break
                pending.popleft()
                self._handle(peer, tag, buffer)
                if tag != Tag.HEARTBEAT:
                    handled += 1
        return handled, caught_up

    def _handle(self, peer: Peer, tag: int, data: bytearray) -> None:
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

    def _merge(self, peer: Peer, data: bytearray) -> None:
        """Check one message of ``peer`` and merge its events: kept as the Avro bytes they came
        as when the compiled reader is built (the Kafka sink splices them as they are), else
        decoded."""
        batch: EventBatch | EncodedBatch | None = None
        try:
            batch = read_encoded(data, peer.rank) if self._config.pass_through else None
            if batch is not None:
                check_encoded(batch, peer.rank, self._size, peer.last_event_id)
            else:
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
        if isinstance(batch, EncodedBatch):
            count = len(batch.events)
            if count:
                self._buffer.extend_encoded(batch.events, batch.windows)
                peer.last_event_id = batch.events.event_id(count - 1)
                self._counters.events_received += count
            return
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
