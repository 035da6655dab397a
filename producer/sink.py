"""``KafkaEventSink``: rank 0's events to a Kafka topic, without ever blocking the engine.

    with KVCacheEventManager(10_000) as manager, KafkaEventSink(manager, "kv-cache-events", "engine-0"):
        run_engine(manager)          # enqueue_* / flush() only; the sink never touches that thread

A sink thread drains the manager, cuts chunks (:mod:`.sink_chunks`), queues them
(:mod:`.sink_queue`) and hands them to librdkafka; a delivery thread runs librdkafka's
callbacks. Every lost event is counted per rank and reported in-band. Threads and cost:
``docs/ARCHITECTURE.md``; messages: ``docs/WIRE_FORMAT.md``; loss accounting: ``docs/OPERATIONS.md``.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Callable, Mapping
from types import TracebackType
from typing import Any, Protocol, Self

from confluent_kafka import Producer
from kvevents.schemas import CONTENT_TYPE, current_fingerprint

from ._sink_base import PURGE_WAIT_S, LibrdkafkaLog, RateLimitedLog, log
from ._sink_delivery import CONTROL_HEADER
from ._sink_drain import Drain
from .buffer import EventDrain, check_timeout
from .sink_chunks import BatchCodec, Chunker, EnvelopeWriter, SingleObjectCodec
from .sink_config import (
    IDEMPOTENT_WINDOW,
    LIBRDKAFKA_DEFAULT_MESSAGE_MAX_BYTES,
    bool_setting,
    int_setting,
    producer_config,
)
from .sink_encoded import EncodedChunker, EncodedDrain
from .sink_queue import ChunkQueue, LossLedger
from .sink_stats import DeliveryReport, LatencyHistogram, SinkCloseReport, SinkStats

__all__ = [
    "CONTROL_HEADER",
    "DEFAULT_HEARTBEAT_S",
    "DEFAULT_MAX_EVENTS_PER_MESSAGE",
    "DEFAULT_MAX_QUEUED_BYTES",
    "DEFAULT_MAX_QUEUED_EVENTS",
    "FINGERPRINT_HEADER",
    "KafkaEventSink",
]

DEFAULT_MAX_QUEUED_EVENTS = 1_000_000
"""Events the sink's queue holds while Kafka is slow or away (about 10 s at 100k events/s)."""
DEFAULT_MAX_QUEUED_BYTES = 256 << 20
"""Encoded bytes the sink's queue holds (librdkafka holds at most 32 MiB more by default)."""
DEFAULT_MAX_EVENTS_PER_MESSAGE = 2000
"""Events per message at most: encoding one message holds the GIL (about 1 ms for 2000 events
here), and a Python engine thread waits that long at worst for it."""
FINGERPRINT_HEADER = "kvevents-schema-fingerprint"
"""Header with the hex CRC-64-AVRO fingerprint of the writer schema (``content-type`` is the other)."""
DEFAULT_HEARTBEAT_S = 5.0
"""Seconds without a message after which the sink sends a batch with no events (a heartbeat)."""


class EventSource(Protocol):
    """What the sink needs of a manager (``KVCacheEventManager`` is one). If it also has
    ``report_lost_events(source_rank, lost_events, newest_event_id, *, where)``, the sink calls
    it for every loss, so the rank's engine learns it must publish a snapshot."""

    @property
    def attention_dp_size(self) -> int | None: ...

    @property
    def closed(self) -> bool: ...

    def drain(self, timeout: float | None = None) -> EventDrain: ...


class KafkaEventSink(Drain):
    """Drains ``manager`` in the background and produces its events to ``topic`` as ``EventBatch``es.

    - ``instance_id``: names the engine instance; the message key and ``EventBatch.instance_id``.
    - ``config``: librdkafka settings, passed through unchanged over the sink's defaults
      (:data:`~kvevents.producer.sink_config.DEFAULT_PRODUCER_CONFIG`); ``bootstrap.servers``
      from here or ``KAFKA_BOOTSTRAP_SERVERS``. ``error_cb``, ``stats_cb`` and ``on_delivery``
      given here are called after the sink's own; a ``logger`` given here replaces the sink's
      (which rate-limits librdkafka's lines into ``kvevents.producer.librdkafka``).
    - ``attention_dp_size``: stamped on every batch; the manager's by default (1 without DP).
    - ``codec``: how messages are framed; Avro single-object encoding by default, or a
      :class:`kvevents.schemas.registry.RegistryCodec` for the Confluent wire format.
    - ``max_queued_events`` / ``max_queued_bytes``: the bound of the sink's queue.
    - ``max_events_per_message``: fewer events per message than the size limit allows, so that
      encoding one never holds the GIL long (a Python engine thread shares it).
    - ``topic_config_timeout``: how long to try reading the topic's ``max.message.bytes`` at
      start (0: do not; messages are then limited by ``message.max.bytes`` alone).
    - ``on_delivery``: called with a :class:`~kvevents.producer.sink_stats.DeliveryReport` for
      every message, delivered or failed (on the delivery thread; keep it short).
    - ``heartbeat_s``: after this many seconds without a message, send a batch with no events
      (a heartbeat: consumers mark an instance stale when they hear nothing for a while);
      None: never. :meth:`close` ends with a batch headed ``kvevents-control: close``.

    Use as a context manager, or call :meth:`close`. Close the manager first (so its last events
    are buffered), then the sink.
    """

    def __init__(
        self,
        manager: EventSource,
        topic: str,
        instance_id: str,
        *,
        config: Mapping[str, Any] | None = None,
        attention_dp_size: int | None = None,
        codec: BatchCodec | None = None,
        max_queued_events: int = DEFAULT_MAX_QUEUED_EVENTS,
        max_queued_bytes: int = DEFAULT_MAX_QUEUED_BYTES,
        max_events_per_message: int = DEFAULT_MAX_EVENTS_PER_MESSAGE,
        topic_config_timeout: float = 5.0,
        on_delivery: Callable[[DeliveryReport], None] | None = None,
        heartbeat_s: float | None = DEFAULT_HEARTBEAT_S,
    ) -> None:
        if not callable(getattr(manager, "drain", None)):
            raise TypeError(f"manager must have drain(timeout) like KVCacheEventManager, got {manager!r}")
        if not isinstance(topic, str) or not topic:
            raise ValueError(f"topic must be a non-empty string, got {topic!r}")
        if not isinstance(instance_id, str) or not instance_id:
            raise ValueError(f"instance_id must be a non-empty string, got {instance_id!r}")
        manager_dp_size = getattr(manager, "attention_dp_size", None)
        if attention_dp_size is None:
            attention_dp_size = manager_dp_size or 1
        if (
            isinstance(attention_dp_size, bool)
            or not isinstance(attention_dp_size, int)
            or attention_dp_size < 1
        ):
            raise ValueError(f"attention_dp_size must be an int >= 1, got {attention_dp_size!r}")
        if topic_config_timeout is None:
            raise ValueError("topic_config_timeout must be a number of seconds >= 0 (0: do not read it)")
        timeout = check_timeout(topic_config_timeout)
        if heartbeat_s is not None and not heartbeat_s > 0:
            raise ValueError(f"heartbeat_s must be a number of seconds > 0 or None, got {heartbeat_s!r}")
        self._heartbeat_s = heartbeat_s
        self._last_produced = time.monotonic()
        self._heartbeats = 0
        if on_delivery is not None and not callable(on_delivery):
            raise TypeError(f"on_delivery must be callable, got {on_delivery!r}")

        self._manager = manager
        self._report_lost: Callable[..., None] | None = getattr(manager, "report_lost_events", None)
        self._topic = topic
        self._instance_id = instance_id
        self._dp_size = attention_dp_size
        self._key = instance_id.encode()
        self._headers = [
            ("content-type", CONTENT_TYPE.encode()),
            (FINGERPRINT_HEADER, current_fingerprint().hex().encode()),
        ]
        self._producer_id = secrets.randbelow((1 << 63) - 1) + 1
        self._codec: BatchCodec = codec if codec is not None else SingleObjectCodec()
        self._writer = EnvelopeWriter(self._codec, instance_id, attention_dp_size)
        per_message = max_events_per_message
        if isinstance(per_message, bool) or not isinstance(per_message, int) or per_message < 1:
            raise ValueError(f"max_events_per_message must be an int >= 1, got {per_message!r}")
        self._chunker = Chunker(self._writer, manager_dp_size in (None, 1), max_events_per_message)
        # a source that has its events as Avro already (EncodedEvents) hands them over as such
        # (a method of its class: a mock's made-up attribute is not taken for one)
        encoded = callable(getattr(type(manager), "drain_encoded", None))
        self._drain: Callable[[float | None], EventDrain | EncodedDrain] = (
            manager.drain_encoded if encoded else manager.drain  # type: ignore[attr-defined]
        )
        self._encoded_chunker = EncodedChunker(
            self._writer, manager_dp_size in (None, 1), max_events_per_message
        )
        self._writer.speculative = self._speculate
        self._queue = ChunkQueue(max_queued_events, max_queued_bytes)
        self._ledger = LossLedger()
        self._on_delivery_report = on_delivery

        # librdkafka configuration; the user's callbacks are chained after the sink's.
        self._config = producer_config(config)
        self._user_error_cb = self._config.pop("error_cb", None)
        self._user_stats_cb = self._config.pop("stats_cb", None)
        self._user_on_delivery = self._config.pop("on_delivery", None)
        self._config.setdefault("logger", LibrdkafkaLog())
        self._config.setdefault("client.id", f"kvevents-sink-{instance_id}"[:200])
        self._user_batch_size = "batch.size" in self._config
        idempotent = bool_setting(self._config, "enable.idempotence", False)
        self._hand_off_window = IDEMPOTENT_WINDOW if idempotent else None
        self._message_max_bytes = int_setting(
            self._config, "message.max.bytes", LIBRDKAFKA_DEFAULT_MESSAGE_MAX_BYTES
        )
        self._topic_max: int | None = None
        self._limit = self._message_max_bytes
        self._budget: int | None = None  # bytes of encoded events per message; set on first use
        self._limit_known = timeout == 0

        # Counters (under _lock).
        self._lock = threading.Lock()
        self._room = threading.Condition(self._lock)  # notified when librdkafka frees room
        self._next_sequence = 0
        self._in_flight = 0
        self._in_flight_events = 0
        self._deliveries = 0  # delivery reports served (each frees room in librdkafka)
        self._full_since: float | None = None  # when librdkafka last refused a message (BufferError)
        self._full_at = 0  # ... and how many reports had been served then
        self._drained = 0
        self._delivered_messages = 0
        self._failed_messages = 0
        self._delivered_events = 0
        self._delivered_bytes = 0
        self._delivered_by_rank: dict[int, int] = {}
        self._failed_by_error: dict[str, int] = {}
        self._errors_by_code: dict[str, int] = {}
        self._split_events = 0
        self._fragments = 0
        self._latency = LatencyHistogram()
        self._fatal: str | None = None
        self._librdkafka_stats: dict[str, Any] = {}
        self._ratelimited = RateLimitedLog(log)

        self._producer = self._new_producer()
        self._describe: tuple[Any, Any, float] | None = None
        if not self._limit_known:
            self._start_topic_describe(timeout or 0.0)

        self._iterations = 0
        self._stop_requested = False
        self._stop_deadline = float("inf")
        self._close_lock = threading.Lock()
        self._close_report: SinkCloseReport | None = None
        self._polling = True
        self._thread = threading.Thread(target=self._run, name="kvevents-sink", daemon=True)
        self._poller = threading.Thread(target=self._poll_loop, name="kvevents-sink-delivery", daemon=True)
        self._poller.start()
        self._thread.start()

    # -- public --------------------------------------------------------------------------

    @property
    def topic(self) -> str:
        return self._topic

    @property
    def instance_id(self) -> str:
        return self._instance_id

    @property
    def producer_id(self) -> int:
        """This sink's random 63-bit ``EventBatch.producer_id``."""
        return self._producer_id

    @property
    def attention_dp_size(self) -> int:
        return self._dp_size

    @property
    def config(self) -> dict[str, Any]:
        """The librdkafka settings in effect (defaults filled in; callbacks left out)."""
        return {k: v for k, v in self._producer_config().items() if not callable(v) and k != "logger"}

    @property
    def closed(self) -> bool:
        return self._close_report is not None

    def stats(self) -> SinkStats:
        """A snapshot of the sink's counters (see :class:`~kvevents.producer.sink_stats.SinkStats`)."""
        with self._lock:
            ledger = self._ledger
            return SinkStats(
                producer_id=self._producer_id,
                messages_produced_total=self._next_sequence,
                messages_delivered_total=self._delivered_messages,
                messages_failed_total=self._failed_messages,
                in_flight_messages=self._in_flight,
                in_flight_events=self._in_flight_events,
                events_drained_total=self._drained,
                events_delivered_total=self._delivered_events,
                bytes_delivered_total=self._delivered_bytes,
                events_split_total=self._split_events,
                fragments_total=self._fragments,
                queued_messages=len(self._queue),
                queued_events=self._queue.events,
                queued_bytes=self._queue.bytes,
                queue_high_water_events=self._queue.high_water_events,
                max_queued_events=self._queue.max_events,
                max_queued_bytes=self._queue.max_bytes,
                message_limit_bytes=self._limit,
                topic_max_message_bytes=self._topic_max,
                delivery_latency=self._latency.snapshot(),
                messages_failed_by_error=dict(self._failed_by_error),
                events_delivered_by_rank=dict(self._delivered_by_rank),
                events_lost_by_rank=ledger.lost_by_rank(),
                events_lost_by_reason=ledger.lost_by_reason(),
                events_lost={reason: dict(counts) for reason, counts in ledger.lost.items()},
                manager_drops_by_rank=dict(ledger.from_manager),
                drops_reported_by_rank=dict(ledger.reported),
                drops_pending_by_rank=ledger.unreported(),
                errors_by_code=dict(self._errors_by_code),
                fatal_error=self._fatal,
                librdkafka=dict(self._librdkafka_stats),
            )

    def wait_delivered(self, timeout: float | None = None) -> bool:
        """Wait until the events the manager buffered before this call are drained and delivered
        (or counted as lost), nothing is in flight and no loss is left unreported; False if
        ``timeout`` seconds passed first. Settle the manager first (``manager.settle()``) to
        include iterations its worker has not buffered yet. Never call it on the engine thread."""
        timeout = check_timeout(timeout)
        deadline = None if timeout is None else time.monotonic() + timeout
        # Two loop starts of the sink thread after this call: it has drained the manager since.
        target = self._iterations + 2
        with self._room:
            self._room.notify_all()
        while True:
            with self._lock:
                idle = not self._queue and self._in_flight == 0 and not self._ledger.pending
            if idle and self._iterations >= target:
                return True
            if not self._thread.is_alive() or (deadline is not None and time.monotonic() >= deadline):
                return False
            time.sleep(0.002)

    def close(self, timeout: float | None = 30.0) -> SinkCloseReport:
        """Drain what the manager still holds, deliver everything within ``timeout`` seconds
        (None: no limit), then purge what is left, stop, and report per rank what was not
        delivered and what no delivered batch reported. Idempotent (returns the same report)."""
        timeout = check_timeout(timeout)
        with self._close_lock:
            if self._close_report is not None:
                return self._close_report
            started = time.monotonic()
            deadline = float("inf") if timeout is None else started + timeout
            with self._room:
                self._stop_requested = True
                self._stop_deadline = deadline
                self._room.notify_all()
            self._thread.join()
            producer = self._producer
            remaining = deadline - time.monotonic()
            left = producer.flush(max(0.0, min(remaining, 1e6)))
            purged = 0
            if left:
                purged = left
                producer.purge(in_queue=True, in_flight=True, blocking=False)
                purge_deadline = time.monotonic() + PURGE_WAIT_S
                while len(producer) and time.monotonic() < purge_deadline:
                    producer.poll(0.05)
            self._polling = False
            self._poller.join()
            with self._lock:
                for chunk in self._queue.take_all():
                    self._lose_chunk_locked(chunk, "unsent_at_close")
                if self._in_flight:  # reports librdkafka never gave back, even after the purge
                    log.error("%d messages neither delivered nor failed at close", self._in_flight)
                undelivered = dict(self._ledger.lost["unsent_at_close"])
                unreported = self._ledger.unreported()
            report = SinkCloseReport(undelivered, unreported, purged, time.monotonic() - started)
            if not report.clean:
                log.warning(
                    "Kafka sink for %r closed with events not delivered (per rank %s) and losses "
                    "not reported in-band (per rank %s)",
                    self._instance_id, undelivered, unreported,
                )  # fmt: skip
            self._close_report = report
            return report

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"KafkaEventSink(topic={self._topic!r}, instance_id={self._instance_id!r})"

    # -- producer ------------------------------------------------------------------------

    def _producer_config(self) -> dict[str, Any]:
        config = dict(self._config)
        config["error_cb"] = self._on_error
        if self._user_stats_cb is not None or "statistics.interval.ms" in config:
            config["stats_cb"] = self._on_stats
        return config

    def _new_producer(self) -> Producer:
        return Producer(self._producer_config())
