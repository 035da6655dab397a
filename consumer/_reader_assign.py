"""An :class:`~kvevents.consumer.reader.EventReader`'s partitions: the topic's metadata and
watermarks, where an assigning read starts, a consumer group's assignments and revocations."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from confluent_kafka import KafkaException, TopicPartition

from ._reader_base import Partition, ReaderError, log
from ._reader_commits import ReaderCommits


class ReaderAssignment(ReaderCommits):
    """Which partitions a reader reads, and from where."""

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
            self._partitions[p] = Partition(offset, offset, high, offset >= high)
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
            state = Partition(position, position, high)
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
