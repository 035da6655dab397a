"""``EventReader``: read kvevents batches from Kafka (confluent-kafka), for indexes and analytics.

Modes: rebuild (from the beginning until caught up), live tail, resume from offsets, consumer
group. :meth:`EventReader.messages` yields raw messages, :meth:`EventReader.batches` decoded
batches, :meth:`EventReader.apply_to` feeds a ``CacheIndex`` through ``apply_encoded``. Malformed
messages, and any whose apply raises something unexpected (not MemoryError), are set aside and
counted (:mod:`.dead_letter`); ``codec=`` (a ``RegistryCodec``) reads
Confluent framing too, message by message. Not thread-safe, except :meth:`EventReader.stop`.
Modes, errors and settings: ``docs/ARCHITECTURE.md`` and ``docs/OPERATIONS.md``. Its parts, one
base class each: ``_reader_loop`` (polling), ``_reader_assign`` (partitions, start offsets),
``_reader_commits``, ``_reader_trouble`` (set-aside messages, client errors), ``_reader_base``.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from types import TracebackType
from typing import TYPE_CHECKING, Any, Self

from confluent_kafka import Consumer, KafkaError, KafkaException, TopicPartition
from kvevents.schemas import DEFAULT_LIMITS, BatchLimits, DecodeError, EventBatch, check_batch, decode_batch

from ._framing import BatchDecoder, index_applier
from ._reader_base import Partition, ReaderError, events_seen
from ._reader_loop import ReaderLoop
from .dead_letter import DeadLetterProducer, MalformedMessage, dead_letter_producer_config
from .reader_metrics import (
    PartitionState,
    ReaderMetrics,
    ReaderProgress,
    ReadResult,
    ThroughputMeter,
)

if TYPE_CHECKING:
    from .index import CacheIndex

__all__ = ["DEFAULT_CONSUMER_CONFIG", "EventReader", "ReaderError"]

log = logging.getLogger(__name__)

DEFAULT_CONSUMER_CONFIG: dict[str, Any] = {
    "auto.offset.reset": "earliest",
    "fetch.max.bytes": 64 * 1024 * 1024,
    "max.partition.fetch.bytes": 16 * 1024 * 1024,
    "queued.max.messages.kbytes": 256 * 1024,
    "fetch.wait.max.ms": 100,
    "socket.nagle.disable": True,
}
"""Defaults under the caller's config. Big fetches: a rebuild reads gigabytes (see
``bench/index.py`` for the measured effect); ``queued.max.messages.kbytes`` bounds the memory
librdkafka uses for prefetched messages. Freshness (``fetch.min.bytes`` stays 1, so
``fetch.wait.max.ms`` only bounds an idle fetch; no Nagle): ``docs/OPERATIONS.md``."""

_FORCED: dict[str, Any] = {
    "enable.partition.eof": True,  # "caught up" is also learned from end-of-partition events
    "enable.auto.commit": False,  # the reader commits what it has processed, nothing earlier
    "enable.auto.offset.store": False,
}


class EventReader(ReaderLoop):
    """Reads one kvevents topic; modes and errors: ``docs/ARCHITECTURE.md``, ``docs/OPERATIONS.md``.

    ``start``: "beginning" (default), "end", or ``{partition: next offset}``; in group mode
    only "beginning"/"end" (where a group without committed offsets starts). ``partitions``
    restricts an assigning reader to some partitions. ``dead_letter_topic`` (with
    ``dead_letter_config`` for its producer; default: this reader's connection and security
    settings) receives malformed messages. ``keep_malformed``: how many set-aside messages
    :attr:`malformed` remembers. ``consume_batch`` / ``poll_timeout_s``: how many messages one
    poll takes at most and how long it waits for the first one (it returns as soon as one
    arrives, so a live tail adds no batching delay). ``codec``: what decodes the messages
    (anything with ``decode_batch(bytes) -> EventBatch``, e.g. a ``RegistryCodec``; default:
    the single-object framing only). ``limits``: what :meth:`batches` accepts
    (:class:`kvevents.schemas.BatchLimits`); a batch beyond them is set aside like a malformed
    one. :meth:`apply_to` uses the index's own limits (``CacheIndex(limits=...)``).
    """

    def __init__(
        self,
        bootstrap_servers: str,
        topic: str,
        *,
        start: str | Mapping[int, int] = "beginning",
        group_id: str | None = None,
        partitions: Sequence[int] | None = None,
        config: Mapping[str, Any] | None = None,
        dead_letter_topic: str | None = None,
        dead_letter_config: Mapping[str, Any] | None = None,
        on_error: Callable[[KafkaError], None] | None = None,
        on_malformed: Callable[[MalformedMessage], None] | None = None,
        keep_malformed: int = 100,
        consume_batch: int = 2000,
        poll_timeout_s: float = 0.2,
        commit_interval_s: float = 1.0,
        metadata_timeout_s: float = 30.0,
        codec: BatchDecoder | None = None,
        limits: BatchLimits | None = None,
    ) -> None:
        if not topic:
            raise ValueError("topic must be a non-empty string")
        if group_id is not None and (partitions is not None or isinstance(start, Mapping)):
            raise ValueError(
                "a consumer group gets its partitions and offsets from Kafka: "
                "partitions and start offsets are for an assigning reader"
            )
        if isinstance(start, str) and start not in ("beginning", "end"):
            raise ValueError(
                f"start must be 'beginning', 'end' or a mapping of partition offsets, got {start!r}"
            )
        if consume_batch < 1 or poll_timeout_s <= 0:
            raise ValueError("consume_batch must be >= 1 and poll_timeout_s > 0")
        self.topic = topic
        self.group_id = group_id
        self.codec = codec
        self._decode: Callable[[Any], EventBatch] = decode_batch if codec is None else codec.decode_batch
        self._on_error = on_error
        self._on_malformed = on_malformed
        self._batch = consume_batch
        self._poll_timeout = poll_timeout_s
        self._commit_interval = commit_interval_s
        self._timeout = metadata_timeout_s
        self._error_logged: dict[int, float] = {}
        self._fatal: KafkaError | None = None
        self._stopping = False
        self._closed = False
        self.errors_total = 0
        self.malformed_total = 0
        self.malformed: deque[MalformedMessage] = deque(maxlen=max(0, keep_malformed))
        self._meter = ThroughputMeter()
        self._partitions: dict[int, Partition] = {}
        self._last_commit = time.monotonic()
        self._uncommitted = False
        self._pending: deque[Any] = deque()  # fetched, not processed: a read that stopped early

        settings: dict[str, Any] = dict(DEFAULT_CONSUMER_CONFIG)
        settings.update(config or {})
        settings.update(_FORCED)
        settings["bootstrap.servers"] = bootstrap_servers
        settings["error_cb"] = self._error
        settings.setdefault("logger", logging.getLogger("kvevents.consumer.librdkafka"))
        if group_id is not None:
            settings["group.id"] = group_id
            if isinstance(start, str):
                settings["auto.offset.reset"] = "earliest" if start == "beginning" else "latest"
        else:
            settings.setdefault("group.id", f"kvevents-reader-{uuid.uuid4().hex[:12]}")  # never joins
        self.config = {k: v for k, v in settings.items() if k not in ("error_cb", "logger")}
        self.limits = DEFAULT_LIMITS if limits is None else limits
        self._dead_letter = (
            None
            if dead_letter_topic is None
            else DeadLetterProducer(
                dead_letter_topic, dict(dead_letter_config or dead_letter_producer_config(settings))
            )
        )
        self._consumer = Consumer(settings)
        try:
            if group_id is None:
                self._assign(start, partitions)
            else:
                self._consumer.subscribe(
                    [topic], on_assign=self._assigned, on_revoke=self._revoked, on_lost=self._lost
                )
        except BaseException:
            self._consumer.close()
            raise

    def offsets(self) -> dict[int, int]:
        """Per assigned partition, the next offset to process: every message before it has been
        fully handled (applied, decoded and yielded, or set aside). What a checkpoint saves."""
        return {p: s.position for p, s in sorted(self._partitions.items()) if s.position is not None}

    def targets(self) -> dict[int, int]:
        """Per assigned partition, the high watermark captured when it was assigned."""
        return {p: s.target for p, s in sorted(self._partitions.items()) if s.target is not None}

    def stop(self) -> None:
        """Make the current (or next) read return: ``messages``/``batches`` after the message they
        are on, ``apply_to`` after the poll it is applying (at most ``consume_batch`` messages).
        Thread-safe."""
        self._stopping = True

    def probe(self, timeout: float = 2.0) -> dict[int, int] | None:
        """Each assigned partition's high watermark, asked of the broker now; None when the broker
        does not answer within ``timeout`` seconds. Call it from the reading thread."""
        highs: dict[int, int] = {}
        try:
            for p in list(self._partitions):
                _, high = self._consumer.get_watermark_offsets(
                    TopicPartition(self.topic, p), timeout=timeout, cached=False
                )
                highs[p] = int(high)
        except KafkaException:
            return None
        return highs

    def metrics(self) -> ReaderMetrics:
        """Counters, per-partition lag (librdkafka's latest known high watermarks; the captured
        targets once closed) and throughput."""
        states = []
        for p, s in sorted(self._partitions.items()):
            marks = None if self._closed else self._watermarks(p, cached=True)
            high = s.target if marks is None else max(marks[1], s.target or 0)
            states.append(PartitionState(p, s.position, high, s.target, s.done))
        dlq = self._dead_letter
        return ReaderMetrics(
            messages_total=self._meter.messages,
            events_total=self._meter.events,
            bytes_total=self._meter.bytes,
            malformed_total=self.malformed_total,
            dead_lettered_total=0 if dlq is None else dlq.delivered,
            dead_letter_failed_total=0 if dlq is None else dlq.failed,
            errors_total=self.errors_total,
            partitions=tuple(states),
            caught_up=self.caught_up,
            overall=self._meter.overall(),
            recent=self._meter.recent(),
        )

    # ------------------------------------------------------------------ reading

    def messages(
        self, *, until_caught_up: bool = False, timeout: float | None = None, max_messages: int | None = None
    ) -> Iterator[Any]:
        """Raw data messages (``confluent_kafka.Message``), in order per partition. A message
        counts as processed once the loop asks for the next one."""
        for message in self._data(until_caught_up, timeout, max_messages):
            yield message
            self._processed(message, 0)

    def batches(
        self, *, until_caught_up: bool = False, timeout: float | None = None, max_messages: int | None = None
    ) -> Iterator[EventBatch]:
        """Decoded batches; malformed messages are set aside (not yielded)."""
        for message in self._data(until_caught_up, timeout, max_messages):
            try:
                batch = self._decode(message.value())
                check_batch(batch, self.limits)
            except DecodeError as exc:
                self._set_aside(message, exc, None)
                self._processed(message, 0)
                continue
            yield batch
            self._processed(message, len(batch.events))

    def decode(self, data: bytes | bytearray | memoryview | None) -> EventBatch:
        """One message's value decoded with this reader's codec; DecodeError if malformed."""
        if data is None:
            raise DecodeError("empty message (a tombstone?)")
        return self._decode(data)

    def apply_to(
        self,
        index: CacheIndex,
        *,
        until_caught_up: bool = True,
        timeout: float | None = None,
        max_messages: int | None = None,
        progress: Callable[[ReaderProgress], None] | None = None,
        progress_interval_s: float = 1.0,
        lock: AbstractContextManager[Any] | None = None,
        on_message: Callable[[Any], None] | None = None,
    ) -> ReadResult:
        """Apply every message to ``index`` with ``apply_encoded`` until caught up (default),
        or, with ``until_caught_up=False``, until :meth:`stop`, ``timeout`` seconds or
        ``max_messages``. ``progress`` is called every ``progress_interval_s`` seconds and at
        the end; ``lock`` is held around each apply (share it with the threads that query).
        ``on_message`` is called with each data message once it is applied or set aside, under
        ``lock`` (e.g. liveness tracking by key, timestamp and headers)."""
        self._check_open()
        guard = lock if lock is not None else nullcontext()
        apply = index_applier(index, self.codec)
        counters = index.counters
        before = events_seen(counters())
        started = time.monotonic()
        totals = [self._meter.messages, self._meter.bytes, self.malformed_total]
        next_progress = started + progress_interval_s
        deadline = None if timeout is None else started + timeout
        left = max_messages
        while True:
            if self._should_return(until_caught_up, deadline, left):
                break
            polled = self._fetch(self._poll_wait(deadline), left)
            nbytes = count = 0
            events_before = events_seen(counters())
            partitions = self._partitions
            deferred: list[Any] = []
            for message in polled:
                if message.error() is not None:
                    if deferred and self._defer_event(message, deferred):
                        continue
                    self._control(message)
                    continue
                partition = partitions.get(message.partition())
                if until_caught_up and partition is not None and partition.beyond(message.offset()):
                    deferred.append(message)  # past this read's target: left for the next read
                    continue
                value = message.value()
                try:
                    with guard:
                        apply(value)
                except DecodeError as exc:
                    with guard:
                        self._set_aside(message, exc, index)
                except MemoryError:
                    raise
                except Exception as exc:  # a bug must not knock the consumer over: set aside, go on
                    log.error("applying the message at offset %d failed", message.offset(), exc_info=exc)
                    with guard:
                        failed = RuntimeError(f"applying failed unexpectedly: {type(exc).__name__}: {exc}")
                        self._set_aside(message, failed, index)
                if on_message is not None:
                    with guard:
                        on_message(message)
                if value is not None:
                    nbytes += len(value)
                count += 1
                if partition is not None:
                    partition.advance(message.offset() + 1)
            if deferred:
                self._pending.extendleft(reversed(deferred))
            if count:
                self._meter.add(count, events_seen(counters()) - events_before, nbytes)
                if left is not None:
                    left -= count
                self._uncommitted = True
            self._after_poll()
            if progress is not None and time.monotonic() >= next_progress:
                progress(self._progress(started, totals, events_seen(counters()) - before))
                next_progress = time.monotonic() + progress_interval_s
        if progress is not None:
            progress(self._progress(started, totals, events_seen(counters()) - before))
        return ReadResult(
            messages=self._meter.messages - totals[0],
            events=events_seen(counters()) - before,
            bytes=self._meter.bytes - totals[1],
            malformed=self.malformed_total - totals[2],
            seconds=time.monotonic() - started,
            caught_up=self.caught_up,
            offsets=self.offsets(),
        )

    def close(self, timeout: float = 10.0) -> None:
        """Commit (consumer group), leave the group, close the consumer and wait up to
        ``timeout`` seconds for dead-letter deliveries. Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            if self.group_id is not None:
                self._commit(None, asynchronous=False)
        finally:
            self._consumer.close()
            if self._dead_letter is not None:
                self._dead_letter.close(timeout)

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        mode = f"group {self.group_id!r}" if self.group_id else "assigned"
        return f"EventReader({self.topic!r}, {mode}, partitions={sorted(self._partitions)}, caught_up={self.caught_up})"
