"""The attention-DP gather on ranks != 0: send the buffered events to rank 0, answer its
control messages, leave with a BYE (``docs/GATHER_PROTOCOL.md``)."""

from __future__ import annotations

import time

from ._gather_core import PROBE_MISSES, GatherCore, log
from ._gather_wire import ProtocolError, Tag, chunk_batches, decode_resync
from .buffer import EventDrain

__all__ = ["SenderRole"]

_EAGER_MESSAGES_PER_DRAIN = 8
"""A drain that needs more messages of ``max_message_bytes`` than this (a backlog: about 64 KB)
goes in this many larger ones: every ``Isend`` releases the GIL, which a rank whose engine
keeps it busy waits to get back, so 80 small sends fell behind where 8 large ones did not."""
_IDLE_WAIT_S = 0.1
"""A rank != 0 with nothing to send waits on its buffer this long at a time (then checks MPI)."""


class SenderRole(GatherCore):
    """The loop of a rank != 0 (``AttentionDpGather`` runs it on its thread)."""

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
            max_bytes=self._config.max_message_bytes,
            max_messages=_EAGER_MESSAGES_PER_DRAIN,
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
        while misses < PROBE_MISSES:
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
        self._send_drain(self._buffer.drain(timeout=0, whole=True), final=True)
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
