"""What an :class:`~kvevents.consumer.reader.EventReader` reports: counters, lag and throughput.

Snapshots are plain frozen values (safe to hand to another thread). Counter names follow the
Prometheus convention (``_total``); lag is per partition: the partition's high watermark minus
the reader's position (the next offset it will process).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

__all__ = ["PartitionState", "ReadResult", "ReaderMetrics", "ReaderProgress", "Throughput", "ThroughputMeter"]


@dataclass(frozen=True, slots=True)
class PartitionState:
    """One partition as the reader sees it.

    ``position``: the next offset the reader will process (None before it knows);
    ``high_watermark``: the latest known end of the partition (librdkafka's cached value while
    fetching); ``target``: the high watermark captured when the partition was assigned, which
    "caught up" means reaching; ``lag``: ``high_watermark - position``.
    """

    partition: int
    position: int | None
    high_watermark: int | None
    target: int | None
    caught_up: bool

    @property
    def lag(self) -> int | None:
        if self.position is None or self.high_watermark is None:
            return None
        return max(0, self.high_watermark - self.position)


@dataclass(frozen=True, slots=True)
class Throughput:
    """Rates over a span of wall-clock time."""

    seconds: float
    messages_per_s: float
    events_per_s: float
    bytes_per_s: float


@dataclass(frozen=True, slots=True)
class ReaderMetrics:
    """A snapshot of an :class:`EventReader`'s counters since it was made.

    - ``messages_total``: data messages processed (malformed ones included); ``bytes_total``:
      their value bytes; ``events_total``: events decoded or applied (counted only where the
      reader decodes: ``batches()`` and ``apply_to``; raw ``messages()`` reads no events);
    - ``malformed_total``: messages set aside (not a valid kvevents batch);
      ``dead_lettered_total`` / ``dead_letter_failed_total``: of those, delivered to / lost on
      the way to the dead-letter topic;
    - ``errors_total``: errors reported by librdkafka (broker down, unknown partition, ...);
    - ``partitions``: position, high watermark and lag of each assigned partition;
      ``lag_total``: their sum;
    - ``overall`` and ``recent`` (the last ``ThroughputMeter.window_s`` seconds) throughput.
    """

    messages_total: int
    events_total: int
    bytes_total: int
    malformed_total: int
    dead_lettered_total: int
    dead_letter_failed_total: int
    errors_total: int
    partitions: tuple[PartitionState, ...]
    caught_up: bool
    overall: Throughput
    recent: Throughput

    @property
    def lag_total(self) -> int:
        return sum(p.lag or 0 for p in self.partitions)


@dataclass(frozen=True, slots=True)
class ReaderProgress:
    """Handed to a progress callback during long reads: how far the read is, how fast it goes.

    ``fraction`` is the share of the way from the start positions to the targets (the high
    watermarks captured at start) covered so far, in 0..1 (1.0 when there was nothing to read);
    ``lag`` the messages still between the positions and those targets.
    """

    elapsed_s: float
    messages: int
    events: int
    bytes: int
    malformed: int
    fraction: float
    lag: int
    events_per_s: float


@dataclass(frozen=True, slots=True)
class ReadResult:
    """What one read (``apply_to``, or a drained iteration) did."""

    messages: int
    events: int
    bytes: int
    malformed: int
    seconds: float
    caught_up: bool
    offsets: dict[int, int] = field(default_factory=dict)
    """The next offset to process per partition when the read ended (what a checkpoint saves)."""

    @property
    def events_per_s(self) -> float:
        return self.events / self.seconds if self.seconds > 0 else 0.0


class ThroughputMeter:
    """Counts and rates: overall since start, and over the last ``window_s`` seconds."""

    def __init__(self, window_s: float = 10.0) -> None:
        self.window_s = window_s
        self._now = time.monotonic
        self.started = self._now()
        self.messages = 0
        self.events = 0
        self.bytes = 0
        self._samples: deque[tuple[float, int, int, int]] = deque()
        self._samples.append((self.started, 0, 0, 0))

    def add(self, messages: int, events: int, nbytes: int) -> None:
        self.messages += messages
        self.events += events
        self.bytes += nbytes

    def sample(self) -> None:
        """Remember the counts now (call now and then; the recent rate spans the samples)."""
        now = self._now()
        samples = self._samples
        samples.append((now, self.messages, self.events, self.bytes))
        while len(samples) > 2 and now - samples[1][0] >= self.window_s:
            samples.popleft()

    def overall(self) -> Throughput:
        return self._rate(self.started, 0, 0, 0)

    def recent(self) -> Throughput:
        self.sample()
        t, m, e, b = self._samples[0]
        return self._rate(t, m, e, b)

    def _rate(self, since: float, messages: int, events: int, nbytes: int) -> Throughput:
        span = self._now() - since
        if span <= 0:
            return Throughput(0.0, 0.0, 0.0, 0.0)
        return Throughput(
            span,
            (self.messages - messages) / span,
            (self.events - events) / span,
            (self.bytes - nbytes) / span,
        )
