"""The sink's message size limit: the topic's ``max.message.bytes`` read at start (an admin
describe, answered on the sink thread before the first hand-off), the producer's
``batch.size`` fitted under it, and the bytes of events a message may carry."""

from __future__ import annotations

import logging
import time

from confluent_kafka import KafkaException

from ._sink_base import SinkState
from .sink_config import (
    LIBRDKAFKA_DEFAULT_BATCH_SIZE,
    SIZE_SAFETY_MARGIN,
    admin_config,
    int_setting,
    message_limit,
)

log = logging.getLogger("kvevents.producer.sink")  # the sink's one logger


class TopicLimit(SinkState):
    """The topic's size limit (part of ``KafkaEventSink``)."""

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
