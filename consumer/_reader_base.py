"""The state an :class:`~kvevents.consumer.reader.EventReader` keeps and its parts
(``_reader_*.py``) share: settings, client, counters, each partition's progress; ``ReaderError``."""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from confluent_kafka import Consumer, KafkaError
from kvevents.schemas import BatchLimits, EventBatch

from ._framing import BatchDecoder
from .dead_letter import DeadLetterProducer, MalformedMessage
from .reader_metrics import ThroughputMeter

log = logging.getLogger(f"{__package__}.reader")  # the reader's logger, for all its parts


class ReaderError(RuntimeError):
    """The reader cannot go on: no such topic, an impossible start offset, a fatal client error."""


@dataclass
class Partition:
    """A read's progress on one partition."""

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


class ReaderBase:
    """What ``EventReader.__init__`` sets up for its parts, and the state they all ask about."""

    topic: str
    group_id: str | None
    codec: BatchDecoder | None
    config: dict[str, Any]
    limits: BatchLimits
    errors_total: int
    malformed_total: int
    malformed: deque[MalformedMessage]
    _decode: Callable[[Any], EventBatch]
    _on_error: Callable[[KafkaError], None] | None
    _on_malformed: Callable[[MalformedMessage], None] | None
    _batch: int
    _poll_timeout: float
    _commit_interval: float
    _timeout: float
    _error_logged: dict[int, float]
    _fatal: KafkaError | None
    _stopping: bool
    _closed: bool
    _meter: ThroughputMeter
    _partitions: dict[int, Partition]
    _last_commit: float
    _uncommitted: bool
    _pending: deque[Any]
    _dead_letter: DeadLetterProducer | None
    _consumer: Consumer

    @property
    def caught_up(self) -> bool:
        """Whether every assigned partition reached the high watermark captured when it was
        assigned (a consumer group without an assignment yet is not caught up)."""
        return bool(self._partitions) and all(p.done for p in self._partitions.values())

    def _check_open(self) -> None:
        if self._closed:
            raise ReaderError("the reader is closed")

    @property
    def closed(self) -> bool:
        return self._closed


def events_seen(counters: Mapping[str, int]) -> int:
    return counters["events_applied"] + counters["events_duplicate"]
