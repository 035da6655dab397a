"""What the live ``kvevents export zmq`` and its replays share: a worker's stream name (topic,
publisher key) and the pipeline that turns Kafka messages into vLLM events per worker, so both
number a stream's batches the same way."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from kvevents.schemas import DecodeError, decode_batch

from ..workers import WorkerKey
from .convert import VllmConverter

__all__ = ["Pipeline", "stream_key", "stream_topic"]

log = logging.getLogger("kvevents.consumer.export.zmq_export")


def stream_topic(
    template: str, key: WorkerKey, model: str, pod_ids: Mapping[WorkerKey, str] | None = None
) -> str:
    """The ZMQ topic of a worker's stream; ``{pod}`` is ``pod_ids``' name for the worker, else the
    instance id, ``-dp<rank>`` added for ranks above 0."""
    pod = pod_ids.get(key) if pod_ids else None
    if pod is None:
        pod = (
            key.instance_id if key.attention_dp_rank == 0 else f"{key.instance_id}-dp{key.attention_dp_rank}"
        )
    return template.format(pod=pod, instance=key.instance_id, rank=key.attention_dp_rank, model=model)


def stream_key(publisher: int, topic: bytes) -> str:
    """A stream's name in ``ZmqExporter.seqs`` and the state file: its publisher (0: the shared
    PUB, then the ``workers`` in order) and ZMQ topic. Each has its own seq, as each vLLM
    publisher has, so workers that share a topic on one publisher share its seq."""
    return f"{publisher}:{topic.decode('utf-8')}"


class Pipeline:
    """Kafka messages -> (worker, events) with deterministic handling of bad messages; shared
    by the live exporter and replays so both number a stream's batches the same way."""

    def __init__(self, converter: VllmConverter, codec: Any = None) -> None:
        self.converter = converter
        self.malformed = 0
        self._decode = decode_batch if codec is None else codec.decode_batch

    def handle(self, message: Any) -> tuple[float, dict[WorkerKey, list[Any]]]:
        """(the batch's creation time in seconds, its vLLM events per worker)."""
        try:
            value = message.value()
            if value is None:
                raise DecodeError("empty message (a tombstone?)")
            batch = self._decode(value)
        except DecodeError as exc:
            self.malformed += 1
            key = message.key()
            log.warning(
                "skipped a malformed message at %s[%d]@%d: %s",
                message.topic(),
                message.partition(),
                message.offset(),
                exc,
            )
            ts = message.timestamp()[1] / 1000.0
            if not key:
                return ts, {}
            instance = key.decode("utf-8", "replace")
            return ts, self.converter.lose_instance(
                instance, "a malformed message of this instance was skipped"
            )
        ts = batch.created_at_us / 1e6 if batch.created_at_us > 0 else message.timestamp()[1] / 1000.0
        return ts, self.converter.convert(batch)
