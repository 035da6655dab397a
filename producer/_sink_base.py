"""What the parts of ``KafkaEventSink`` share: its state's declaration, timings, the rate-limited
logs and the record of a message in flight. The parts: :mod:`._sink_limit` (the topic's size
limit), :mod:`._sink_delivery` (hand-off, produce, delivery reports, loss accounting),
:mod:`._sink_drain` (the sink thread); the class and its public methods: :mod:`.sink`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from confluent_kafka import KafkaError, Producer
from kvevents.schemas import RankDrops

from .buffer import EventDrain
from .sink_chunks import BatchCodec, Chunk, Chunker, EnvelopeWriter
from .sink_encoded import EncodedChunker, EncodedDrain
from .sink_queue import ChunkQueue, LossLedger
from .sink_stats import DeliveryReport, LatencyHistogram

log = logging.getLogger("kvevents.producer.sink")
librdkafka_log = logging.getLogger("kvevents.producer.librdkafka")

IDLE_WAIT_S = 0.1
STUCK_WAIT_S = 0.01
FULL_RETRY_S = 0.5
POLL_S = 0.1
PURGE_WAIT_S = 5.0
LOG_INTERVAL_S = 10.0
PURGED = frozenset({KafkaError._PURGE_QUEUE, KafkaError._PURGE_INFLIGHT})
BLOCKED = object()


@dataclass(slots=True, eq=False)
class InFlight:
    chunk: Chunk
    sequence: int
    carried: list[RankDrops]
    size: int
    produced_at: float


class RateLimitedLog:
    """At most one record per interval per key; counts what it suppressed."""

    def __init__(self, logger: logging.Logger, interval: float = LOG_INTERVAL_S) -> None:
        self._logger = logger
        self._interval = interval
        self._last: dict[str, float] = {}
        self._suppressed: dict[str, int] = {}

    def __call__(self, level: int, key: str, message: str, *args: object) -> None:
        now = time.monotonic()
        last = self._last.get(key)
        if last is not None and now - last < self._interval:
            self._suppressed[key] = self._suppressed.get(key, 0) + 1
            return
        self._last[key] = now
        suppressed = self._suppressed.pop(key, 0)
        if suppressed:
            message += " (%d similar messages suppressed)"
            args = (*args, suppressed)
        self._logger.log(level, message, *args)


class LibrdkafkaLog:
    """librdkafka's log lines into ``kvevents.producer.librdkafka``, at most one per facility and
    level every 10 s (a broker that is away makes librdkafka log each reconnect attempt)."""

    def __init__(self) -> None:
        self._limited = RateLimitedLog(librdkafka_log)

    def log(self, level: int, message: str, *args: object) -> None:
        facility = str(args[0]) if args else ""
        self._limited(level, f"{level}:{facility}", message, *args)


class SinkState:
    """The state the sink's parts share (set in ``KafkaEventSink.__init__``), declared once so
    each part, a mixin of its own module, is checked against it."""

    _manager: Any
    _report_lost: Callable[..., None] | None
    _topic: str
    _instance_id: str
    _dp_size: int
    _key: bytes
    _headers: list[tuple[str, bytes]]
    _producer_id: int
    _codec: BatchCodec
    _writer: EnvelopeWriter
    _chunker: Chunker
    _encoded_chunker: EncodedChunker
    _drain: Callable[[float | None], EventDrain | EncodedDrain]
    _queue: ChunkQueue
    _ledger: LossLedger
    _on_delivery_report: Callable[[DeliveryReport], None] | None
    _config: dict[str, Any]
    _user_error_cb: Any
    _user_stats_cb: Any
    _user_on_delivery: Any
    _user_batch_size: bool
    _hand_off_window: int | None
    _message_max_bytes: int
    _topic_max: int | None
    _limit: int
    _budget: int | None
    _limit_known: bool
    _lock: threading.Lock
    _room: threading.Condition
    _next_sequence: int
    _in_flight: int
    _in_flight_events: int
    _deliveries: int
    _full_since: float | None
    _full_at: int
    _drained: int
    _delivered_messages: int
    _failed_messages: int
    _delivered_events: int
    _delivered_bytes: int
    _delivered_by_rank: dict[int, int]
    _failed_by_error: dict[str, int]
    _errors_by_code: dict[str, int]
    _split_events: int
    _fragments: int
    _latency: LatencyHistogram
    _fatal: str | None
    _librdkafka_stats: dict[str, Any]
    _ratelimited: RateLimitedLog
    _producer: Producer
    _describe: tuple[Any, Any, float] | None
    _heartbeat_s: float | None
    _last_produced: float
    _heartbeats: int
    _iterations: int
    _stop_requested: bool
    _stop_deadline: float
    _polling: bool

    def _new_producer(self) -> Producer:
        """A librdkafka producer with the sink's settings (``KafkaEventSink``)."""
        raise NotImplementedError


def call_safely(callback: Callable[..., object], *args: object) -> None:
    try:
        callback(*args)
    except Exception:
        log.exception("A Kafka sink callback (%r) raised", callback)
