"""Malformed messages: what the reader keeps about them, and the optional dead-letter topic.

A message that is not a valid kvevents batch is counted, remembered (the last few), optionally
produced unchanged to a dead-letter topic with ``kvevents-error`` and ``kvevents-source-*``
headers (listed in ``docs/OPERATIONS.md``), and the reader goes on.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from confluent_kafka import KafkaError, KafkaException, Producer

__all__ = ["DEAD_LETTER_HEADERS", "DeadLetterProducer", "MalformedMessage", "dead_letter_producer_config"]

log = logging.getLogger(__name__)

DEAD_LETTER_HEADERS = (
    "kvevents-error",
    "kvevents-source-topic",
    "kvevents-source-partition",
    "kvevents-source-offset",
    "kvevents-source-timestamp",
)
"""The headers a dead-lettered message gains."""

_SHARED_PREFIXES = ("security.", "sasl.", "ssl.", "client.", "socket.", "broker.", "metadata.", "api.")
_SHARED_KEYS = frozenset({"bootstrap.servers", "client.id", "logger", "log_level", "debug", "error_cb"})


@dataclass(frozen=True, slots=True)
class MalformedMessage:
    """A message the reader set aside: where it was, its key, and what was wrong."""

    topic: str
    partition: int
    offset: int
    key: bytes | None
    error: str
    value_bytes: int


def dead_letter_producer_config(consumer_config: Mapping[str, Any]) -> dict[str, Any]:
    """The consumer settings that also apply to a producer on the same cluster (address,
    security, client id, logging), plus idempotence; consumer-only settings are left out."""
    config = {k: v for k, v in consumer_config.items() if k in _SHARED_KEYS or k.startswith(_SHARED_PREFIXES)}
    config.setdefault("enable.idempotence", True)
    config.setdefault("linger.ms", 50)
    return config


class DeadLetterProducer:
    """Produces set-aside messages to ``topic``; counts deliveries and failures."""

    def __init__(self, topic: str, config: Mapping[str, Any]) -> None:
        self.topic = topic
        self._producer = Producer(dict(config))
        self._lock = threading.Lock()
        self.delivered = 0
        self.failed = 0

    def send(self, message: Any, malformed: MalformedMessage) -> None:
        """Produce a copy of ``message`` (a confluent_kafka ``Message``) with the error headers."""
        headers = list(message.headers() or [])
        headers += [
            ("kvevents-error", malformed.error.encode("utf-8", "replace")),
            ("kvevents-source-topic", malformed.topic.encode()),
            ("kvevents-source-partition", str(malformed.partition).encode()),
            ("kvevents-source-offset", str(malformed.offset).encode()),
        ]
        kind, timestamp = message.timestamp()
        if kind != 0 and timestamp >= 0:  # TIMESTAMP_NOT_AVAILABLE is 0
            headers.append(("kvevents-source-timestamp", str(timestamp).encode()))
        try:
            self._producer.produce(
                self.topic,
                value=message.value(),
                key=message.key(),
                headers=headers,
                on_delivery=self._delivered,
            )
        except (BufferError, KafkaException, ValueError) as exc:
            log.warning(
                "could not hand a malformed message (%s:%d@%d) to the dead-letter topic %s: %s",
                malformed.topic,
                malformed.partition,
                malformed.offset,
                self.topic,
                exc,
            )
            with self._lock:
                self.failed += 1
        self._producer.poll(0)

    def _delivered(self, err: KafkaError | None, _msg: Any) -> None:
        with self._lock:
            if err is None:
                self.delivered += 1
            else:
                self.failed += 1
        if err is not None:
            log.warning(
                "a malformed message could not be delivered to the dead-letter topic %s: %s", self.topic, err
            )

    def poll(self) -> None:
        self._producer.poll(0)

    def close(self, timeout: float = 10.0) -> int:
        """Wait up to ``timeout`` seconds for deliveries; returns how many are still undelivered
        (counted as failed)."""
        left = self._producer.flush(timeout)
        if left:
            log.warning(
                "%d malformed messages were not delivered to the dead-letter topic %s", left, self.topic
            )
            with self._lock:
                self.failed += left
        return int(left)
