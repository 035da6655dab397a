"""An :class:`~kvevents.consumer.reader.EventReader`'s offset commits (consumer group mode)."""

from __future__ import annotations

import time

from confluent_kafka import OFFSET_INVALID, KafkaError, KafkaException, TopicPartition

from ._reader_base import log
from ._reader_trouble import ReaderTrouble


class ReaderCommits(ReaderTrouble):
    """Committing the processed offsets of a consumer group."""

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
