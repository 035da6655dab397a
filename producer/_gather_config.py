"""The attention-DP gather's tuning (:class:`GatherConfig`), its stats snapshot
(:class:`GatherStats`) and the counters behind it. What each setting does to the protocol:
``docs/GATHER_PROTOCOL.md``."""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["Counters", "GatherConfig", "GatherStats"]


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
      in flight (a batch is cut into messages by ``max_events_per_message`` and
      ``max_message_bytes``, so at most ``max_in_flight - 1`` plus one batch's messages are in
      flight).
    - ``max_events_per_message``: events per MPI message (bounds the time rank 0 holds the GIL
      decoding one message: about 0.5 us per event).
    - ``max_message_bytes``: bytes per MPI message (one event larger than this still goes
      alone; a backlog of more than 8 such messages goes in 8 larger ones): keep it within the
      MPI library's eager limit (MPICH's shared memory: 8,112 bytes with its default 8 KiB
      cells), so that every send completes at once, without the rendezvous that needs both
      ranks' gather threads to come back to MPI several times.
    - ``poll_interval_s``: how often rank 0 looks for messages while events flow (at most a
      quarter period; every 50 ms after a second without events).
    - ``pass_through``: rank 0 keeps the other ranks' events as the Avro bytes they came as
      (checked whole, not decoded) and the Kafka sink splices those bytes into its messages;
      False decodes them into objects (as without the compiled reader).
    """

    heartbeat_interval_s: float = 0.5
    heartbeat_timeout_s: float = 5.0
    shutdown_timeout_s: float = 5.0
    max_in_flight: int = 8
    max_events_per_message: int = 1024
    max_message_bytes: int = 8000
    poll_interval_s: float = 0.001
    pass_through: bool = True

    def __post_init__(self) -> None:
        for name in ("heartbeat_interval_s", "heartbeat_timeout_s", "shutdown_timeout_s", "poll_interval_s"):
            _positive(name, getattr(self, name))
        for name in ("max_in_flight", "max_events_per_message", "max_message_bytes"):
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


class Counters:
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
