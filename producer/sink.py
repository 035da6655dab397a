"""``KafkaEventSink``: rank 0's events to a Kafka topic, without ever blocking the engine.

    with KVCacheEventManager(10_000) as manager, KafkaEventSink(manager, "kv-cache-events", "engine-0"):
        run_engine(manager)          # enqueue_* / flush() only; the sink never touches that thread

A sink thread drains the manager, cuts chunks (:mod:`.sink_chunks`), queues them
(:mod:`.sink_queue`) and hands them to librdkafka; a delivery thread runs librdkafka's
callbacks. Every lost event is counted per rank and reported in-band. Threads and cost:
``docs/ARCHITECTURE.md``; messages: ``docs/WIRE_FORMAT.md``; loss accounting: ``docs/OPERATIONS.md``.
"""

from __future__ import annotations

import functools
import json
import logging
import secrets
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Protocol, Self

from confluent_kafka import KafkaError, KafkaException, Producer
from kvevents.schemas import CONTENT_TYPE, EventBatch, KVCacheEvent, RankDrops, current_fingerprint

from .buffer import EventDrain, check_timeout
from .sink_chunks import (
    EMPTY_EVENTS,
    BatchCodec,
    Chunk,
    Chunker,
    EnvelopeWriter,
    LostEvent,
    SingleObjectCodec,
)
from .sink_config import (
    LIBRDKAFKA_DEFAULT_BATCH_SIZE,
    LIBRDKAFKA_DEFAULT_MESSAGE_MAX_BYTES,
    SIZE_SAFETY_MARGIN,
    admin_config,
    int_setting,
    message_limit,
    producer_config,
)
from .sink_encoded import EncodedChunker, EncodedDrain, EncodedEvents
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

log = logging.getLogger(__name__)
librdkafka_log = logging.getLogger("kvevents.producer.librdkafka")

DEFAULT_MAX_QUEUED_EVENTS = 1_000_000
"""Events the sink's queue holds while Kafka is slow or away (about 10 s at 100k events/s)."""
DEFAULT_MAX_QUEUED_BYTES = 256 << 20
"""Encoded bytes the sink's queue holds (librdkafka holds at most 32 MiB more by default)."""
DEFAULT_MAX_EVENTS_PER_MESSAGE = 2000
"""Events per message at most: encoding one message holds the GIL (about 1 ms for 2000 events
here), and a Python engine thread waits that long at worst for it."""
FINGERPRINT_HEADER = "kvevents-schema-fingerprint"
CONTROL_HEADER = "kvevents-control"
"""Header of a sink's last batch (value ``close``): the instance stopped cleanly (the consumer's
liveness tracking drops its workers); carried in a header so the Avro envelope is unchanged."""
DEFAULT_HEARTBEAT_S = 5.0
"""Header with the hex CRC-64-AVRO fingerprint of the writer schema (``content-type`` is the other)."""

_IDLE_WAIT_S = 0.1
_STUCK_WAIT_S = 0.01
_FULL_RETRY_S = 0.5
_POLL_S = 0.1
_PURGE_WAIT_S = 5.0
_LOG_INTERVAL_S = 10.0
_PURGED = frozenset({KafkaError._PURGE_QUEUE, KafkaError._PURGE_INFLIGHT})
_BLOCKED = object()


class EventSource(Protocol):
    """What the sink needs of a manager (``KVCacheEventManager`` is one). If it also has
    ``report_lost_events(source_rank, lost_events, newest_event_id, *, where)``, the sink calls
    it for every loss, so the rank's engine learns it must publish a snapshot."""

    @property
    def attention_dp_size(self) -> int | None: ...

    @property
    def closed(self) -> bool: ...

    def drain(self, timeout: float | None = None) -> EventDrain: ...


@dataclass(slots=True, eq=False)
class _InFlight:
    chunk: Chunk
    sequence: int
    carried: list[RankDrops]
    size: int
    produced_at: float


class _RateLimitedLog:
    """At most one record per interval per key; counts what it suppressed."""

    def __init__(self, logger: logging.Logger, interval: float = _LOG_INTERVAL_S) -> None:
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


class _LibrdkafkaLog:
    """librdkafka's log lines into ``kvevents.producer.librdkafka``, at most one per facility and
    level every 10 s (a broker that is away makes librdkafka log each reconnect attempt)."""

    def __init__(self) -> None:
        self._limited = _RateLimitedLog(librdkafka_log)

    def log(self, level: int, message: str, *args: object) -> None:
        facility = str(args[0]) if args else ""
        self._limited(level, f"{level}:{facility}", message, *args)


class KafkaEventSink:
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
        self._config.setdefault("logger", _LibrdkafkaLog())
        self._config.setdefault("client.id", f"kvevents-sink-{instance_id}"[:200])
        self._user_batch_size = "batch.size" in self._config
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
        self._ratelimited = _RateLimitedLog(log)

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
                purge_deadline = time.monotonic() + _PURGE_WAIT_S
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

    def _poll_loop(self) -> None:
        while self._polling:
            try:
                self._producer.poll(_POLL_S)
            except Exception:
                log.exception("Kafka sink: a librdkafka callback failed")

    # -- the topic's size limit ----------------------------------------------------------

    def _start_topic_describe(self, timeout: float) -> None:
        try:
            from confluent_kafka.admin import AdminClient, ConfigResource, ResourceType

            admin = AdminClient(admin_config(self._config))
            resource = ConfigResource(ResourceType.TOPIC, self._topic)
            future = admin.describe_configs([resource], request_timeout=timeout)[resource]
        except (KafkaException, ValueError, TypeError) as exc:  # size by message.max.bytes alone
            log.warning("Could not ask for topic %r's max.message.bytes (%s)", self._topic, exc)
            self._limit_known = True
            return
        self._describe = (admin, future, time.monotonic() + timeout)

    def _resolve_topic_limit(self) -> None:
        """Once the describe answered (or timed out), fix the message limit and, if needed,
        the producer's ``batch.size``. Runs on the sink thread before the first hand-off."""
        if self._limit_known or self._describe is None:
            return
        _admin, future, deadline = self._describe
        if future.done():
            try:
                entries = future.result()
                self._topic_max = int(entries["max.message.bytes"].value)
            except (KafkaException, KeyError, ValueError, TypeError) as exc:  # no permission, no topic, ...
                log.warning(
                    "Could not read topic %r's max.message.bytes (%s); messages are limited by "
                    "message.max.bytes=%d alone: set it below the topic's limit if that is smaller",
                    self._topic, exc, self._message_max_bytes,
                )  # fmt: skip
        elif time.monotonic() < deadline:
            return
        else:
            log.warning(
                "Topic %r's max.message.bytes unknown: no answer in time (is Kafka up?); messages are "
                "limited by message.max.bytes=%d alone: set it below the topic's limit if that is smaller",
                self._topic, self._message_max_bytes,
            )  # fmt: skip
        self._describe = None
        limit = message_limit(self._message_max_bytes, self._topic_max)
        batch_size = int_setting(self._config, "batch.size", LIBRDKAFKA_DEFAULT_BATCH_SIZE)
        if self._topic_max is not None and batch_size > self._topic_max - SIZE_SAFETY_MARGIN:
            if self._user_batch_size:
                log.warning(
                    "batch.size=%d exceeds topic %r's max.message.bytes=%d: the broker may reject batches",
                    batch_size, self._topic, self._topic_max,
                )  # fmt: skip
            else:  # nothing was produced yet: a producer that packs smaller requests
                self._config["batch.size"] = max(1, self._topic_max - SIZE_SAFETY_MARGIN)
                old = self._producer
                self._producer = self._new_producer()
                old.flush(0)
        with self._lock:
            self._limit = limit
            self._budget = None
            self._limit_known = True

    def _current_budget(self) -> int:
        if self._budget is None:
            overhead = len(self._key) + sum(len(k) + len(v) + 4 for k, v in self._headers)
            budget = self._limit - overhead - SIZE_SAFETY_MARGIN - self._writer.max_prefix_size()
            if budget < 64:
                log.error(
                    "A message limit of %d bytes leaves %d bytes for events: most events will be "
                    "dropped as oversized", self._limit, budget,
                )  # fmt: skip
                budget = 64
            self._budget = budget
        return self._budget

    # -- the sink thread -------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._loop()
        except Exception:
            log.exception("The Kafka sink thread failed; queued events are counted as lost")
            with self._lock:
                for chunk in self._queue.take_all():
                    self._lose_chunk_locked(chunk, "unsent_at_close")

    def _loop(self) -> None:
        manager = self._manager
        while True:
            self._iterations += 1
            stopping = self._stop_requested
            if stopping:
                self._accept(self._drain(0))
            self._resolve_topic_limit()
            stuck = self._hand_off()
            if stopping and (not stuck or time.monotonic() >= self._stop_deadline):
                if not stuck:
                    self._say_closing()
                return
            if stuck or stopping or manager.closed:
                with self._room:
                    if self._stop_requested == stopping:
                        self._room.wait(_STUCK_WAIT_S if stuck else _IDLE_WAIT_S)
                if not stopping:
                    self._accept(self._drain(0))
            else:
                self._accept(self._drain(_IDLE_WAIT_S))

    def _accept(self, drain: EventDrain | EncodedDrain) -> None:
        """Count the drain's drops, cut its events into chunks and queue them (handing them off
        as they come, so encoding overlaps librdkafka's compression and sending)."""
        if drain.dropped:
            with self._lock:
                self._ledger.manager_dropped(drain.dropped)
        events = drain.events
        if not events:
            return
        accounted = 0
        chunker = self._encoded_chunker if isinstance(events, EncodedEvents) else self._chunker
        try:
            with self._lock:
                self._drained += len(events)
                budget = self._current_budget()
            for item in chunker.chunks(events, budget):
                with self._lock:
                    if isinstance(item, LostEvent):
                        accounted += 1
                        self._lose_event_locked(item)
                    else:
                        if item.split is None:
                            accounted += item.events
                        elif item.first_event_block_offset == 0:
                            accounted += 1
                            self._split_events += 1
                            self._fragments += item.split.fragments
                        for dropped in self._queue.push(item):
                            self._lose_chunk_locked(dropped, "queue_full")
                if self._limit_known:
                    self._hand_off()
        except Exception:
            rest = events[accounted:]
            log.exception("Could not encode %d KV-cache events; counted as lost", len(rest))
            with self._lock:
                self._lose_locked(_count_by_rank(rest), "unencodable")

    def _speculate(self, first_event_block_offset: int) -> EventBatch | None:
        """The envelope the next message gets if it is produced at once: only when nothing waits
        in the queue (else it is framed at hand-off)."""
        with self._lock:
            if not self._limit_known or self._queue or self._full_since is not None:
                return None
            pending = self._ledger.pending
            dropped = [RankDrops(rank, pending[rank]) for rank in sorted(pending)]
            sequence = self._next_sequence
        return EventBatch(
            self._instance_id,
            [],
            attention_dp_size=self._dp_size,
            producer_id=self._producer_id,
            sequence=sequence,
            created_at_us=time.time_ns() // 1000,
            dropped=dropped,
            first_event_block_offset=first_event_block_offset,
        )

    def _lose_event_locked(self, lost: LostEvent) -> None:
        self._lose_locked({lost.rank: 1}, lost.reason, {lost.rank: lost.event_id})
        self._ratelimited(
            logging.ERROR, lost.reason, "Dropped KV-cache event %d of rank %d (%s): %s",
            lost.event_id, lost.rank, lost.reason, lost.detail,
        )  # fmt: skip

    def _lose_chunk_locked(self, chunk: Chunk, reason: str) -> None:
        counts = dict(chunk.by_rank)
        split = chunk.split
        if split is not None and split.lose():
            counts[split.rank] = counts.get(split.rank, 0) + 1
        self._lose_locked(counts, reason, chunk.last_event_ids)

    def _lose_locked(
        self, counts: dict[int, int], reason: str, newest_event_ids: Mapping[int, int] | None = None
    ) -> None:
        """Count a loss (in-band in the next batch) and tell the manager, whose rank must then
        publish a snapshot (not for events still unsent at close: the engine has stopped)."""
        self._ledger.lose(counts, reason)
        report = self._report_lost
        if report is None or reason == "unsent_at_close":
            return
        for rank, count in counts.items():
            newest = None if newest_event_ids is None else newest_event_ids.get(rank)
            try:
                report(rank, count, newest, where=f"lost by the Kafka sink ({reason})")
            except Exception:  # a listener's bug must not stop the sink's accounting
                log.exception("report_lost_events failed")

    def _hand_off(self) -> bool:
        """Hand queued chunks, then any pending drops, to librdkafka; True when something must
        wait (librdkafka's queue is full, or the message limit is not known yet)."""
        if not self._limit_known:
            return bool(self._queue) or bool(self._ledger.pending)
        with self._lock:
            queue = self._queue
            if self._full_since is not None:
                # librdkafka refused the last message for lack of room: try again only when a
                # delivery report freed some, or after a while (no message framed in vain)
                if self._deliveries == self._full_at and time.monotonic() - self._full_since < _FULL_RETRY_S:
                    return bool(queue) or bool(self._ledger.pending)
                self._full_since = None
            budget = self._current_budget()
            while queue:
                chunk = queue.peek()
                if chunk.size > budget:
                    self._resplit_head_locked(chunk, budget)
                    continue
                if self._produce_locked(chunk) is _BLOCKED:
                    return True
                queue.pop()
            if self._ledger.pending and self._in_flight == 0:
                empty = Chunk(EMPTY_EVENTS, 0, {}, {})
                return self._produce_locked(empty) is _BLOCKED
            if (
                self._heartbeat_s is not None
                and not self._stop_requested
                and time.monotonic() - self._last_produced >= self._heartbeat_s
            ):
                # idle: a batch with no events tells consumers this instance is alive
                if self._produce_locked(Chunk(EMPTY_EVENTS, 0, {}, {})) is _BLOCKED:
                    return True
                self._heartbeats += 1
        return False

    def _say_closing(self) -> None:
        """The last batch: no events, header ``kvevents-control: close`` (a clean stop)."""
        with self._lock:
            if self._fatal is None:
                self._produce_locked(Chunk(EMPTY_EVENTS, 0, {}, {}), closing=True)

    def _resplit_head_locked(self, chunk: Chunk, budget: int) -> None:
        """Cut the head chunk again: it was made before the topic's smaller limit was known."""
        speculative, self._writer.speculative = self._writer.speculative, None  # it takes the lock
        try:
            self._resplit_head(chunk, budget)
        finally:
            self._writer.speculative = speculative

    def _resplit_head(self, chunk: Chunk, budget: int) -> None:
        whole = (
            self._writer.template_prefix() + chunk.part if chunk.envelope is None else chunk.encoded_message()
        )
        events = self._codec.decode_batch(whole).events
        replacement: list[Chunk] = []
        for item in self._chunker.chunks(events, budget):
            if isinstance(item, LostEvent):
                if chunk.split is not None:
                    self._lose_chunk_locked(Chunk(EMPTY_EVENTS, 0, {}, {}, split=chunk.split), item.reason)
                else:
                    self._lose_event_locked(item)
                continue
            if chunk.split is not None:  # a fragment cut into smaller fragments of the same event
                item.first_event_block_offset += chunk.first_event_block_offset
                item.split = chunk.split
            elif item.split is not None and item.first_event_block_offset == 0:
                self._split_events += 1
                self._fragments += item.split.fragments
            replacement.append(item)
        if chunk.split is not None and replacement:
            chunk.split.fragments += len(replacement) - 1
            self._fragments += len(replacement) - 1
        self._queue.replace_head(replacement)

    def _produce_locked(self, chunk: Chunk, *, closing: bool = False) -> object:
        carried = self._ledger.take()
        sequence = self._next_sequence
        guess = chunk.envelope
        try:
            if (
                guess is not None
                and guess.sequence == sequence
                and guess.dropped == carried
                and guess.first_event_block_offset == chunk.first_event_block_offset
            ):
                value = chunk.encoded_message()  # encoded with this very envelope: as it is
            else:
                value = self._writer.message(
                    chunk.part,
                    producer_id=self._producer_id,
                    sequence=sequence,
                    created_at_us=time.time_ns() // 1000,
                    dropped=carried,
                    first_event_block_offset=chunk.first_event_block_offset,
                )
        except Exception:
            self._ledger.restore(carried)
            log.exception("Could not frame a message of %d events; counted as lost", chunk.events)
            self._lose_chunk_locked(chunk, "unencodable")
            return None
        record = _InFlight(chunk, sequence, carried, len(value), time.monotonic())
        try:
            self._producer.produce(
                self._topic,
                value,
                self._key,
                headers=[*self._headers, (CONTROL_HEADER, b"close")] if closing else self._headers,  # type: ignore[arg-type]  # list is invariant in the stub
                on_delivery=functools.partial(self._delivered, record),
            )
        except BufferError:
            self._ledger.restore(carried)
            self._full_since = time.monotonic()
            self._full_at = self._deliveries
            return _BLOCKED
        except KafkaException as exc:
            self._ledger.restore(carried)
            error = exc.args[0] if exc.args else exc
            name = error.name() if isinstance(error, KafkaError) else type(exc).__name__
            self._failed_by_error[name] = self._failed_by_error.get(name, 0) + 1
            self._lose_chunk_locked(chunk, "produce_failed")
            self._ratelimited(
                logging.ERROR, f"produce:{name}",
                "librdkafka refused a message of %d bytes (%d events): %s; counted as lost",
                len(value), chunk.events, error,
            )  # fmt: skip
            return None
        self._next_sequence = sequence + 1
        self._last_produced = time.monotonic()
        self._in_flight += 1
        self._in_flight_events += chunk.events
        return None

    # -- librdkafka callbacks (delivery thread, or close) -----------------------------------

    def _delivered(self, record: _InFlight, err: KafkaError | None, msg: Any) -> None:
        latency = msg.latency() if msg is not None else None
        latency = float(latency) if latency is not None else time.monotonic() - record.produced_at
        chunk = record.chunk
        with self._room:
            self._deliveries += 1
            self._in_flight -= 1
            self._in_flight_events -= chunk.events
            if err is None:
                self._delivered_messages += 1
                self._delivered_bytes += record.size
                by_rank = self._delivered_by_rank
                for rank, n in chunk.by_rank.items():
                    by_rank[rank] = by_rank.get(rank, 0) + n
                delivered = chunk.events if chunk.split is None else 0
                if chunk.split is not None and chunk.split.deliver():
                    delivered = 1
                    by_rank[chunk.split.rank] = by_rank.get(chunk.split.rank, 0) + 1
                self._delivered_events += delivered
                self._ledger.delivered(record.carried)
                self._latency.observe(latency)
            else:
                self._failed_messages += 1
                name = err.name()
                self._failed_by_error[name] = self._failed_by_error.get(name, 0) + 1
                self._ledger.restore(record.carried)
                purged = err.code() in _PURGED
                self._lose_chunk_locked(chunk, "unsent_at_close" if purged else "delivery_failed")
                if not purged:
                    self._ratelimited(
                        logging.ERROR, f"delivery:{name}",
                        "Kafka did not take batch %d (%d events): %s; counted as lost and reported in-band",
                        record.sequence, chunk.events, err,
                    )  # fmt: skip
            self._room.notify_all()
        if self._on_delivery_report is not None:
            report = DeliveryReport(
                sequence=record.sequence,
                events=chunk.events,
                events_by_rank=dict(chunk.by_rank) if chunk.split is None else {chunk.split.rank: 1},
                last_event_id_by_rank=dict(chunk.last_event_ids),
                dropped={d.attention_dp_rank: d.dropped_events for d in record.carried},
                size_bytes=record.size,
                first_event_block_offset=chunk.first_event_block_offset,
                produced_at=record.produced_at,
                latency_s=latency,
                acked_at=record.produced_at + latency,
                error=err,
                partition=msg.partition() if msg is not None and err is None else None,
                offset=msg.offset() if msg is not None and err is None else None,
            )
            _call_safely(self._on_delivery_report, report)
        if self._user_on_delivery is not None:
            _call_safely(self._user_on_delivery, err, msg)

    def _on_error(self, err: KafkaError) -> None:
        name = err.name()
        with self._lock:
            self._errors_by_code[name] = self._errors_by_code.get(name, 0) + 1
            if err.fatal():
                self._fatal = str(err)
        if err.fatal():
            log.error("Kafka producer fatal error: %s; every further batch will fail (counted)", err)
        else:
            self._ratelimited(logging.WARNING, f"error:{name}", "Kafka producer: %s", err)
        if self._user_error_cb is not None:
            _call_safely(self._user_error_cb, err)

    def _on_stats(self, stats_json: str) -> None:
        try:
            stats = json.loads(stats_json)
        except ValueError:
            stats = {}
        kept = {key: stats[key] for key in _LIBRDKAFKA_STATS if key in stats}
        brokers = stats.get("brokers") or {}
        rtts = [b.get("rtt", {}).get("p99", 0) for b in brokers.values() if isinstance(b, dict)]
        if rtts:
            kept["broker_rtt_p99_us"] = max(rtts)
        with self._lock:
            self._librdkafka_stats = kept
        if self._user_stats_cb is not None:
            _call_safely(self._user_stats_cb, stats_json)


_LIBRDKAFKA_STATS = (
    "msg_cnt",
    "msg_size",
    "msg_max",
    "msg_size_max",
    "txmsgs",
    "txmsg_bytes",
    "tx",
    "txbytes",
)
"""Top-level librdkafka statistics the sink keeps (messages/bytes queued, sent)."""


def _count_by_rank(events: Sequence[KVCacheEvent]) -> dict[int, int]:
    if isinstance(events, EncodedEvents):
        return events.count_by_rank()
    counts: dict[int, int] = {}
    for event in events:
        rank = 0 if event.attention_dp_rank is None else event.attention_dp_rank
        counts[rank] = counts.get(rank, 0) + 1
    return counts


def _call_safely(callback: Callable[..., object], *args: object) -> None:
    try:
        callback(*args)
    except Exception:
        log.exception("A Kafka sink callback (%r) raised", callback)
