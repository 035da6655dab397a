"""An :class:`~kvevents.consumer.reader.EventReader`'s trouble: malformed messages set aside
(counted, logged, dead-lettered, their instance's workers marked degraded) and client errors."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from confluent_kafka import KafkaError

from ._reader_base import ReaderBase, log
from .dead_letter import MalformedMessage

if TYPE_CHECKING:
    from .index import CacheIndex

_ERROR_LOG_INTERVAL_S = 10.0


class ReaderTrouble(ReaderBase):
    """Setting a message aside; a Kafka client error."""

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
            index.mark_instance_degraded(instance, reason)
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
