"""An :class:`~kvevents.consumer.reader.EventReader`'s read loop: polling (messages an earlier read
left first), deferring what lies past a read's target, end-of-partition events, when to return,
progress."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

from confluent_kafka import KafkaError

from ._reader_assign import ReaderAssignment
from ._reader_base import ReaderError
from .reader_metrics import ReaderProgress

_EOF = KafkaError._PARTITION_EOF


class ReaderLoop(ReaderAssignment):
    """The parts of the loop ``messages``, ``batches`` and ``apply_to`` share."""

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
