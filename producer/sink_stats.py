"""What the Kafka sink reports: per-message delivery reports, counter snapshots, the close report.

Like :mod:`.stats`, snapshots are copies (reading one never races with the sink's threads) and
field names are Prometheus-friendly (``_total`` counters, ``_by_<label>`` dicts).
"""

from __future__ import annotations

import bisect
from collections import deque
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "LATENCY_BUCKETS_S",
    "DeliveryReport",
    "LatencyHistogram",
    "LatencySnapshot",
    "SinkCloseReport",
    "SinkStats",
]

LATENCY_BUCKETS_S: tuple[float, ...] = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
)  # fmt: skip
"""Upper bounds of the delivery latency histogram's buckets (seconds; +Inf is implied)."""


@dataclass(frozen=True, slots=True)
class DeliveryReport:
    """The outcome of one produced message, handed to the sink's ``on_delivery`` callback.

    ``events``: the events it held (a fragment of a split Stored event counts 1);
    ``events_by_rank`` / ``last_event_id_by_rank``: per source rank, how many and the last id;
    ``dropped``: the in-band drop counts it carried; ``latency_s``: from ``produce`` to the
    broker's acknowledgement (or failure), as librdkafka measured it; ``acked_at``: the
    ``time.monotonic()`` of that acknowledgement; ``error``: None when delivered, else the
    ``confluent_kafka.KafkaError``.
    """

    sequence: int
    events: int
    events_by_rank: dict[int, int]
    last_event_id_by_rank: dict[int, int]
    dropped: dict[int, int]
    size_bytes: int
    first_event_block_offset: int
    produced_at: float
    latency_s: float
    acked_at: float
    error: Any
    partition: int | None
    offset: int | None

    @property
    def delivered(self) -> bool:
        return self.error is None


@dataclass(frozen=True, slots=True)
class LatencySnapshot:
    """A delivery latency histogram: cumulative-free counts per bucket (``bucket_bounds_s`` plus
    +Inf last), their sum and count, and quantiles of the most recent deliveries."""

    bucket_bounds_s: tuple[float, ...]
    bucket_counts: tuple[int, ...]
    count: int
    sum_s: float
    recent_p50_s: float | None
    recent_p99_s: float | None


class LatencyHistogram:
    """Counts delivery latencies into fixed buckets, and keeps the last ``recent`` for quantiles.
    Not thread-safe: the sink updates it under its lock."""

    def __init__(self, bounds: tuple[float, ...] = LATENCY_BUCKETS_S, recent: int = 2048) -> None:
        self._bounds = bounds
        self._counts = [0] * (len(bounds) + 1)
        self._sum = 0.0
        self._count = 0
        self._recent: deque[float] = deque(maxlen=recent)

    def observe(self, seconds: float) -> None:
        self._counts[bisect.bisect_left(self._bounds, seconds)] += 1
        self._sum += seconds
        self._count += 1
        self._recent.append(seconds)

    def snapshot(self) -> LatencySnapshot:
        recent = sorted(self._recent)
        p50 = recent[len(recent) // 2] if recent else None
        p99 = recent[min(len(recent) - 1, int(len(recent) * 0.99))] if recent else None
        return LatencySnapshot(self._bounds, tuple(self._counts), self._count, self._sum, p50, p99)


@dataclass(frozen=True, slots=True)
class SinkStats:
    """A snapshot of one :class:`~kvevents.producer.sink.KafkaEventSink`.

    Flow: ``events_drained_total`` events taken from the manager; ``messages_produced_total``
    messages handed to librdkafka (= the next ``sequence``); of those
    ``messages_delivered_total`` acknowledged (``events_delivered_total``, ``bytes_delivered_total``
    value bytes) and ``messages_failed_total`` failed (``messages_failed_by_error``, by librdkafka
    error name); ``in_flight_messages`` (holding ``in_flight_events``) neither yet. ``events_split_total`` Stored events cut into
    ``fragments_total`` messages.

    Queue: ``queued_messages``/``queued_events``/``queued_bytes`` waiting for librdkafka (room
    in its queue, or, idempotent, fewer than 5 unacknowledged), at most
    ``max_queued_events``/``max_queued_bytes`` (``queue_high_water_events``).

    Loss, per source rank: ``events_lost_by_rank`` the sink lost itself (all reasons; by reason in
    ``events_lost_by_reason``, and by reason and rank in ``events_lost``); ``manager_drops_by_rank`` drops the manager reported;
    ``drops_reported_by_rank`` losses of either kind carried in-band by a delivered batch;
    ``drops_pending_by_rank`` losses no delivered batch carried yet (waiting, or in flight).

    Kafka: ``message_limit_bytes`` the largest message produced (``message.max.bytes`` and the
    topic's ``max.message.bytes`` when it could be read: ``topic_max_message_bytes``);
    ``errors_by_code`` what librdkafka's ``error_cb`` reported; ``fatal_error`` if the producer
    hit one; ``librdkafka`` the last ``stats_cb`` figures (when ``statistics.interval.ms`` is set).
    """

    producer_id: int
    messages_produced_total: int
    messages_delivered_total: int
    messages_failed_total: int
    in_flight_messages: int
    in_flight_events: int
    events_drained_total: int
    events_delivered_total: int
    bytes_delivered_total: int
    events_split_total: int
    fragments_total: int
    queued_messages: int
    queued_events: int
    queued_bytes: int
    queue_high_water_events: int
    max_queued_events: int
    max_queued_bytes: int
    message_limit_bytes: int
    topic_max_message_bytes: int | None
    delivery_latency: LatencySnapshot
    messages_failed_by_error: dict[str, int] = field(default_factory=dict)
    events_delivered_by_rank: dict[int, int] = field(default_factory=dict)
    events_lost_by_rank: dict[int, int] = field(default_factory=dict)
    events_lost_by_reason: dict[str, int] = field(default_factory=dict)
    events_lost: dict[str, dict[int, int]] = field(default_factory=dict)
    manager_drops_by_rank: dict[int, int] = field(default_factory=dict)
    drops_reported_by_rank: dict[int, int] = field(default_factory=dict)
    drops_pending_by_rank: dict[int, int] = field(default_factory=dict)
    errors_by_code: dict[str, int] = field(default_factory=dict)
    fatal_error: str | None = None
    librdkafka: dict[str, Any] = field(default_factory=dict)

    @property
    def events_lost_total(self) -> int:
        """Events the sink itself lost (not counting the manager's drops)."""
        return sum(self.events_lost_by_rank.values())


@dataclass(frozen=True, slots=True)
class SinkCloseReport:
    """What :meth:`KafkaEventSink.close` could not do.

    ``undelivered_by_rank``: events not acknowledged by Kafka at close (left in the queue, or in
    librdkafka and purged), per source rank; ``unreported_by_rank``: every loss, per source rank,
    that no delivered batch carried in-band, so consumers will not learn of it from the topic
    (the undelivered events, and earlier losses still pending); ``clean``: both are empty.
    """

    undelivered_by_rank: dict[int, int]
    unreported_by_rank: dict[int, int]
    messages_purged: int
    seconds: float

    @property
    def clean(self) -> bool:
        return not self.undelivered_by_rank and not self.unreported_by_rank
