"""Decoded messages of an events topic with where they came from, for ``tail`` and ``stats``.

:func:`decoded_messages` reads raw messages from an :class:`~kvevents.consumer.EventReader`,
decodes each, and yields a :class:`Received` (the batch and its partition, offset and Kafka
timestamp). A message that does not decode is handed to ``on_malformed`` as a
:class:`Malformed` (with partition and offset) and counted; it never stops the read.
:func:`start_offsets_for_time` finds, per partition, the first offset at or after a time (for
``--since``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvevents.schemas import DecodeError, EventBatch

if TYPE_CHECKING:
    from kvevents.consumer import EventReader

__all__ = ["Malformed", "Received", "decoded_messages", "message_time_us", "start_offsets_for_time"]


@dataclass(frozen=True)
class Received:
    """One decoded batch and where it was read."""

    batch: EventBatch
    partition: int
    offset: int
    timestamp_ms: int | None
    """The Kafka record timestamp (None when the broker gave none)."""
    size: int

    @property
    def time_us(self) -> int:
        """When the batch was made: its ``created_at_us``, else the record timestamp, else 0."""
        return message_time_us(self.batch, self.timestamp_ms)


@dataclass(frozen=True)
class Malformed:
    """A message that is not a kvevents batch."""

    partition: int
    offset: int
    key: bytes | None
    size: int
    error: str

    def describe(self, topic: str) -> str:
        key = "" if self.key is None else f" (key {self.key.decode('utf-8', 'replace')!r})"
        return f"malformed message at {topic}[{self.partition}]@{self.offset}{key}, {self.size} bytes: {self.error}"


def message_time_us(batch: EventBatch, timestamp_ms: int | None) -> int:
    """The batch's ``created_at_us`` when the producer set it, else the Kafka timestamp."""
    if batch.created_at_us > 0:
        return batch.created_at_us
    return 0 if timestamp_ms is None or timestamp_ms < 0 else timestamp_ms * 1000


def _timestamp_ms(message: Any) -> int | None:
    kind, value = message.timestamp()
    return int(value) if kind != 0 and value >= 0 else None  # 0: TIMESTAMP_NOT_AVAILABLE


def decoded_messages(
    reader: EventReader,
    *,
    follow: bool,
    on_malformed: Callable[[Malformed], None],
    timeout: float | None = None,
) -> Iterator[Received]:
    """Every message of ``reader`` decoded, in order per partition; ``follow=False`` stops when
    caught up (the watermarks captured when the reader started), ``follow=True`` runs until
    the reader is stopped or ``timeout`` seconds passed."""
    for message in reader.messages(until_caught_up=not follow, timeout=timeout):
        value = message.value()
        size = 0 if value is None else len(value)
        try:
            batch = reader.decode(value)
        except DecodeError as exc:
            error = str(exc)
            if reader.codec is None and value and value[0] == 0:
                error += " (pass --schema-registry-url to read it)"
            on_malformed(Malformed(message.partition(), message.offset(), message.key(), size, error))
            continue
        yield Received(batch, message.partition(), message.offset(), _timestamp_ms(message), size)


def start_offsets_for_time(
    bootstrap_servers: str, topic: str, time_ms: int, config: dict[str, str], timeout: float = 30.0
) -> dict[int, int]:
    """Per partition of ``topic``, the first offset whose record timestamp is >= ``time_ms``
    (the high watermark when there is none)."""
    from confluent_kafka import Consumer, TopicPartition

    consumer = Consumer(
        {**config, "bootstrap.servers": bootstrap_servers, "group.id": "kvevents-offsets-for-time"}
    )
    try:
        metadata = consumer.list_topics(topic, timeout=timeout)
        info = metadata.topics.get(topic)
        if info is None or info.error is not None or not info.partitions:
            raise ValueError(f"topic {topic!r} not found")
        wanted = [TopicPartition(topic, p, time_ms) for p in sorted(info.partitions)]
        found = consumer.offsets_for_times(wanted, timeout=timeout)
        offsets = {}
        for tp in found:
            if tp.offset >= 0:
                offsets[tp.partition] = tp.offset
            else:  # no record that late: start at the end
                offsets[tp.partition] = consumer.get_watermark_offsets(
                    TopicPartition(topic, tp.partition), timeout=timeout
                )[1]
        return offsets
    finally:
        consumer.close()
