"""``EventReader``: read kvevents batches from Kafka (confluent-kafka), for indexes and analytics.

Modes: rebuild (from the beginning until caught up), live tail, resume from offsets, consumer
group. :meth:`EventReader.messages` yields raw messages, :meth:`EventReader.batches` decoded
batches, :meth:`EventReader.apply_to` feeds a ``CacheIndex`` through ``apply_encoded``. Malformed
messages, and any whose apply raises something unexpected (not MemoryError), are set aside and
counted (:mod:`.dead_letter`); ``codec=`` (a ``RegistryCodec``) reads
Confluent framing too, message by message. Not thread-safe, except :meth:`EventReader.stop`.
Modes, errors and settings: ``docs/ARCHITECTURE.md`` and ``docs/OPERATIONS.md``.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING, Any, Self

from confluent_kafka import OFFSET_INVALID, Consumer, KafkaError, KafkaException, TopicPartition
from kvevents.schemas import DEFAULT_LIMITS, BatchLimits, DecodeError, EventBatch, check_batch, decode_batch

from ._framing import BatchDecoder, index_applier
from .dead_letter import DeadLetterProducer, MalformedMessage, dead_letter_producer_config
from .reader_metrics import (
    PartitionState,
    ReaderMetrics,
    ReaderProgress,
    ReadResult,
    ThroughputMeter,
)
from .workers import WorkerKey

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
_ERROR_LOG_INTERVAL_S = 10.0
_EOF = KafkaError._PARTITION_EOF


class ReaderError(RuntimeError):
    """The reader cannot go on: no such topic, an impossible start offset, a fatal client error."""


@dataclass
class _Partition:
    start: int | None  # where this read began (None: not known yet, group mode)
    position: int | None  # next offset to process
    target: int | None  # high watermark captured when assigned
    done: bool = False

    def beyond(self, offset: int) -> bool:
        """Whether ``offset`` lies past the target of a partition that reached it."""
        return self.done and self.target is not None and offset >= self.target

    def advance(self, position: int) -> None:
        self.position = position
        if not self.done and self.target is not None and position >= self.target:
            self.done = True


class EventReader:
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
        self._partitions: dict[int, _Partition] = {}
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

    # ------------------------------------------------------------------ setup

    def _topic_partitions(self) -> list[int]:
        try:
            metadata = self._consumer.list_topics(self.topic, timeout=self._timeout)
        except KafkaException as exc:
            raise ReaderError(f"cannot read the metadata of topic {self.topic!r}: {exc}") from exc
        info = metadata.topics.get(self.topic)
        if info is None or info.error is not None:
            problem = "not found" if info is None else str(info.error)
            raise ReaderError(f"topic {self.topic!r}: {problem}")
        if not info.partitions:
            raise ReaderError(f"topic {self.topic!r} has no partitions (does it exist?)")
        return sorted(info.partitions)

    def _watermarks(self, partition: int, cached: bool = False) -> tuple[int, int] | None:
        try:
            low, high = self._consumer.get_watermark_offsets(
                TopicPartition(self.topic, partition), timeout=self._timeout, cached=cached
            )
        except KafkaException as exc:
            if cached:
                return None
            raise ReaderError(f"cannot read the watermarks of {self.topic}[{partition}]: {exc}") from exc
        if low < 0 or high < 0:
            return None
        return int(low), int(high)

    def _assign(self, start: str | Mapping[int, int], only: Sequence[int] | None) -> None:
        existing = self._topic_partitions()
        chosen = existing if only is None else sorted(set(only))
        unknown = sorted(set(chosen) - set(existing))
        if isinstance(start, Mapping):
            unknown += sorted(set(start) - set(existing) - set(unknown))
        if unknown:
            raise ReaderError(f"topic {self.topic!r} has partitions {existing}, not {unknown}")
        assignment = []
        for p in chosen:
            marks = self._watermarks(p)
            if marks is None:
                raise ReaderError(f"no watermarks for {self.topic}[{p}]")
            low, high = marks
            if start == "beginning":
                offset = low
            elif start == "end":
                offset = high
            else:
                offset = int(start.get(p, low))  # type: ignore[union-attr]
                if offset > high:
                    raise ReaderError(
                        f"start offset {offset} of {self.topic}[{p}] is beyond its end ({high}): "
                        "is this the topic the offsets were taken from? (recreated or truncated?)"
                    )
                if offset < low:
                    log.warning(
                        "%s[%d]: offsets %d..%d were deleted by retention; reading from %d "
                        "(the index marks the workers whose batches are missing as degraded)",
                        self.topic,
                        p,
                        offset,
                        low - 1,
                        low,
                    )
                    offset = low
            self._partitions[p] = _Partition(offset, offset, high, offset >= high)
            assignment.append(TopicPartition(self.topic, p, offset))
        self._consumer.assign(assignment)

    def _assigned(self, consumer: Any, assigned: list[TopicPartition]) -> None:
        committed: dict[int, int] = {}
        try:
            for tp in consumer.committed(assigned, timeout=self._timeout):
                if tp.offset >= 0:
                    committed[tp.partition] = tp.offset
        except KafkaException as exc:
            log.warning("could not read the committed offsets of %s: %s", self.group_id, exc)
        for tp in assigned:
            marks = self._watermarks(tp.partition)
            high = None if marks is None else marks[1]
            position = committed.get(tp.partition)
            if position is None and marks is not None:
                position = (
                    marks[0]
                    if self.config.get("auto.offset.reset") in ("earliest", "smallest", "beginning")
                    else marks[1]
                )
            state = _Partition(position, position, high)
            if position is not None and high is not None:
                state.done = position >= high
            self._partitions[tp.partition] = state

    def _revoked(self, consumer: Any, revoked: list[TopicPartition]) -> None:
        self._commit([tp.partition for tp in revoked], asynchronous=False)
        for tp in revoked:
            self._partitions.pop(tp.partition, None)

    def _lost(self, consumer: Any, lost: list[TopicPartition]) -> None:
        for tp in lost:
            self._partitions.pop(tp.partition, None)

    # ------------------------------------------------------------------ state

    @property
    def caught_up(self) -> bool:
        """Whether every assigned partition reached the high watermark captured when it was
        assigned (a consumer group without an assignment yet is not caught up)."""
        return bool(self._partitions) and all(p.done for p in self._partitions.values())

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
        before = _events_seen(counters())
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
            events_before = _events_seen(counters())
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
                self._meter.add(count, _events_seen(counters()) - events_before, nbytes)
                if left is not None:
                    left -= count
                self._uncommitted = True
            self._after_poll()
            if progress is not None and time.monotonic() >= next_progress:
                progress(self._progress(started, totals, _events_seen(counters()) - before))
                next_progress = time.monotonic() + progress_interval_s
        if progress is not None:
            progress(self._progress(started, totals, _events_seen(counters()) - before))
        return ReadResult(
            messages=self._meter.messages - totals[0],
            events=_events_seen(counters()) - before,
            bytes=self._meter.bytes - totals[1],
            malformed=self.malformed_total - totals[2],
            seconds=time.monotonic() - started,
            caught_up=self.caught_up,
            offsets=self.offsets(),
        )

    # ------------------------------------------------------------------ the loop's parts

    def _data(self, until_caught_up: bool, timeout: float | None, max_messages: int | None) -> Iterator[Any]:
        self._check_open()
        deadline = None if timeout is None else time.monotonic() + timeout
        left = max_messages
        while not self._should_return(until_caught_up, deadline, left):
            polled = self._fetch(self._poll_wait(deadline), left)
            i = 0
            deferred: list[Any] = []
            try:
                while i < len(polled):
                    message = polled[i]
                    if message.error() is not None:
                        if not (deferred and self._defer_event(message, deferred)):
                            self._control(message)
                    elif until_caught_up and self._beyond_target(message):
                        deferred.append(message)
                    else:
                        yield message  # processed (by the caller) once it asks for the next
                        if left is not None:
                            left -= 1
                    i += 1
                    if self._stopping:
                        break
            finally:
                rest = deferred + polled[i:]  # past the target, or the caller stopped early
                if rest:
                    self._pending.extendleft(reversed(rest))
            self._after_poll()

    @staticmethod
    def _defer_event(event: Any, deferred: list[Any]) -> bool:
        """Defer an event of a partition whose messages were deferred (an end-of-partition
        event must not move the position past them); True if it was."""
        partition = event.partition()
        if any(m.partition() == partition for m in deferred):
            deferred.append(event)
            return True
        return False

    def _beyond_target(self, message: Any) -> bool:
        partition = self._partitions.get(message.partition())
        return partition is not None and partition.beyond(message.offset())

    def _should_return(self, until_caught_up: bool, deadline: float | None, left: int | None) -> bool:
        if self._fatal is not None:
            raise ReaderError(f"fatal Kafka client error: {self._fatal}")
        if self._stopping:
            self._stopping = False  # one stop() ends one read
            return True
        return (
            (until_caught_up and self.caught_up)
            or (deadline is not None and time.monotonic() >= deadline)
            or (left is not None and left <= 0)
        )

    def _poll_wait(self, deadline: float | None) -> float:
        if deadline is None:
            return self._poll_timeout
        return max(0.0, min(self._poll_timeout, deadline - time.monotonic()))

    def _fetch(self, wait: float, left: int | None) -> list[Any]:
        """One poll (messages an earlier read left behind first): data messages and, in their
        place, events (end of partition, errors) for :meth:`_control`."""
        count = self._batch if left is None else max(1, min(self._batch, left))
        if self._pending:
            pending = self._pending
            return [pending.popleft() for _ in range(min(count, len(pending)))]
        consumer = self._consumer
        ready = consumer.consume(count, 0)  # what librdkafka has fetched already
        if ready or wait <= 0:
            return ready
        # Nothing yet: wait for the first message only (consume(count, wait) would hold a live
        # tail's message until `count` arrive or `wait` passes: +100-400 ms end to end).
        first = consumer.poll(wait)
        if first is None:
            return []
        return [first, *consumer.consume(count - 1, 0)] if count > 1 else [first]

    def _control(self, message: Any) -> bool:
        """Handle an event that is not data (end of partition, error); True if it was one."""
        err = message.error()
        if err is None:
            return False
        if err.code() == _EOF:
            partition = self._partitions.get(message.partition())
            if partition is not None and message.offset() >= 0:
                partition.advance(max(partition.position or 0, message.offset()))
            return True
        self._error(err)
        return True

    def _processed(self, message: Any, events: int) -> None:
        partition = self._partitions.get(message.partition())
        if partition is not None:
            partition.advance(message.offset() + 1)
        value = message.value()
        self._meter.add(1, events, 0 if value is None else len(value))
        self._uncommitted = True

    def _after_poll(self) -> None:
        if self._dead_letter is not None:
            self._dead_letter.poll()
        if (
            self.group_id is not None
            and self._uncommitted
            and time.monotonic() - self._last_commit >= self._commit_interval
        ):
            self._commit(None, asynchronous=True)

    def _progress(self, started: float, totals: list[int], events: int) -> ReaderProgress:
        covered = total = remaining = 0
        for s in self._partitions.values():
            if s.start is None or s.target is None or s.position is None:
                continue
            total += max(0, s.target - s.start)
            covered += max(0, min(s.position, s.target) - s.start)
            remaining += max(0, s.target - s.position)
        elapsed = time.monotonic() - started
        self._meter.sample()
        return ReaderProgress(
            elapsed_s=elapsed,
            messages=self._meter.messages - totals[0],
            events=events,
            bytes=self._meter.bytes - totals[1],
            malformed=self.malformed_total - totals[2],
            fraction=1.0 if total == 0 else covered / total,
            lag=remaining,
            events_per_s=events / elapsed if elapsed > 0 else 0.0,
        )

    # ------------------------------------------------------------------ trouble

    def _set_aside(self, message: Any, exc: Exception, index: CacheIndex | None) -> None:
        value = message.value()
        malformed = MalformedMessage(
            topic=message.topic() or self.topic,
            partition=message.partition(),
            offset=message.offset(),
            key=message.key(),
            error=str(exc),
            value_bytes=0 if value is None else len(value),
        )
        self.malformed_total += 1
        self.malformed.append(malformed)
        log.warning(
            "set aside a malformed message at %s[%d]@%d: %s",
            malformed.topic,
            malformed.partition,
            malformed.offset,
            malformed.error,
        )
        if index is not None and malformed.key:
            instance = malformed.key.decode("utf-8", "replace")
            reason = f"a malformed message of this instance was skipped ({malformed.topic}[{malformed.partition}]@{malformed.offset})"
            for worker in index.workers():
                if worker.instance_id == instance:
                    index.mark_degraded(WorkerKey(*worker), reason)
        if self._dead_letter is not None:
            self._dead_letter.send(message, malformed)
        if self._on_malformed is not None:
            self._on_malformed(malformed)

    def _error(self, err: KafkaError) -> None:
        self.errors_total += 1
        if err.fatal():
            self._fatal = err
        if self._on_error is not None:
            self._on_error(err)
            return
        now = time.monotonic()
        code = err.code()
        if now - self._error_logged.get(code, -_ERROR_LOG_INTERVAL_S) >= _ERROR_LOG_INTERVAL_S:
            self._error_logged[code] = now
            log.warning("Kafka error reading %s (%d so far): %s", self.topic, self.errors_total, err)

    # ------------------------------------------------------------------ commits and closing

    def commit(self, *, asynchronous: bool = False) -> None:
        """Commit the processed offsets of a consumer group (no-op for an assigning reader)."""
        self._check_open()
        if self.group_id is not None:
            self._commit(None, asynchronous=asynchronous)

    def _commit(self, partitions: list[int] | None, *, asynchronous: bool) -> None:
        offsets = [
            TopicPartition(self.topic, p, s.position)
            for p, s in self._partitions.items()
            if s.position is not None
            and s.position != OFFSET_INVALID
            and (partitions is None or p in partitions)
        ]
        self._last_commit = time.monotonic()
        self._uncommitted = False
        if not offsets:
            return
        try:
            if asynchronous:
                self._consumer.commit(offsets=offsets, asynchronous=True)
            else:
                self._consumer.commit(offsets=offsets, asynchronous=False)
        except KafkaException as exc:
            err = exc.args[0] if exc.args and isinstance(exc.args[0], KafkaError) else None
            if err is not None and err.code() == KafkaError._NO_OFFSET:
                return
            log.warning("could not commit offsets of group %s: %s", self.group_id, exc)
            self.errors_total += 1

    def _check_open(self) -> None:
        if self._closed:
            raise ReaderError("the reader is closed")

    @property
    def closed(self) -> bool:
        return self._closed

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


def _events_seen(counters: Mapping[str, int]) -> int:
    return counters["events_applied"] + counters["events_duplicate"]
