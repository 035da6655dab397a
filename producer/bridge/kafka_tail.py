"""What the topic already holds of one instance: per rank the last event id (and, when that is a
Stored event, how many of its blocks: a bridge killed while the sink was sending a split event
may have left only its first fragments), read back from the end of the topic when a bridge
restarts. This is exact where the bridge's own acknowledgement file cannot be (a message the
broker stored whose acknowledgement the killed bridge never got)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

from kvevents.schemas import DecodeError, EventBatch, KVCacheStoredData, decode_batch

__all__ = ["TailEvent", "last_event_ids", "last_events"]

log = logging.getLogger(__name__)


class TailEvent(NamedTuple):
    """The last event of one rank in the topic: its id and, for a Stored event, the blocks the
    topic holds of it (counted from block 0 through the fragments read), else None."""

    event_id: int
    blocks: int | None


def last_event_ids(bootstrap: str, topic: str, instance_id: str, **kwargs: Any) -> dict[int, int]:
    """Per rank, the highest event id of ``instance_id``'s batches (see :func:`last_events`)."""
    return {r: e.event_id for r, e in last_events(bootstrap, topic, instance_id, **kwargs).items()}


def last_events(
    bootstrap: str,
    topic: str,
    instance_id: str,
    *,
    ranks: int = 1,
    config: Mapping[str, Any] | None = None,
    step: int = 500,
    max_back: int = 200_000,
    timeout: float = 10.0,
    decode: Callable[[bytes], EventBatch] = decode_batch,
) -> dict[int, TailEvent]:
    """Per rank, the highest event id (with its blocks) of ``instance_id``'s batches in ``topic``: each partition
    is read backwards in windows of ``step`` messages until one holds a batch of the instance
    (at most ``max_back`` messages back) for every rank ``0..ranks-1``. ``decode``: how messages
    are framed (single-object by default; a registry codec's ``decode_batch``). Raises ``RuntimeError`` when the topic cannot be read."""
    from confluent_kafka import Consumer, KafkaError, KafkaException, TopicPartition

    settings = {
        "bootstrap.servers": bootstrap,
        "group.id": "kvevents-bridge-tail",
        "enable.auto.commit": False,
        "enable.partition.eof": True,
        "isolation.level": "read_committed",
        **{
            k: v
            for k, v in (config or {}).items()
            if not k.startswith(
                (
                    "linger",
                    "batch",
                    "acks",
                    "enable.idempotence",
                    "compression",
                    "queue.buffering",
                    "message.timeout",
                    "retries",
                )
            )
        },
    }
    consumer = Consumer(settings)
    key = instance_id.encode()
    found: dict[int, int] = {}
    blocks: dict[int, int | None] = {}
    try:
        meta = consumer.list_topics(topic, timeout=timeout)
        info = meta.topics.get(topic)
        if info is None or info.error is not None:
            raise RuntimeError(f"topic {topic} cannot be read: {None if info is None else info.error}")
        for partition in sorted(info.partitions):
            low, high = consumer.get_watermark_offsets(TopicPartition(topic, partition), timeout=timeout)
            end = high
            while end > low and high - end < max_back:
                start = max(low, end - step)
                consumer.assign([TopicPartition(topic, partition, start)])
                while True:
                    msg = consumer.poll(timeout)
                    if msg is None:
                        raise RuntimeError(f"no answer reading {topic}[{partition}] at {start}")
                    error = msg.error()
                    if error is not None:
                        if error.code() == KafkaError._PARTITION_EOF:
                            break
                        raise RuntimeError(f"reading {topic}[{partition}]: {error}")
                    if (msg.offset() or 0) >= end:
                        break
                    value = msg.value()
                    if msg.key() != key or value is None:
                        continue
                    try:
                        batch = decode(value)
                    except DecodeError as exc:
                        log.warning(
                            "%s[%d]@%d unreadable while looking for the last event ids: %s",
                            topic,
                            partition,
                            msg.offset(),
                            exc,
                        )
                        continue
                    for i, event in enumerate(batch.events):
                        rank = event.attention_dp_rank or 0
                        if event.event_id > found.get(rank, -1):
                            found[rank] = event.event_id
                            blocks[rank] = None
                        data = event.data
                        if event.event_id == found[rank] and isinstance(data, KVCacheStoredData):
                            # a fragment (first event, offset > 0) holds blocks offset.., in order
                            start = batch.first_event_block_offset if i == 0 else 0
                            blocks[rank] = max(blocks[rank] or 0, start + len(data.blocks))
                if all(r in found for r in range(ranks)):
                    break
                end = start
    except KafkaException as exc:
        raise RuntimeError(f"topic {topic} cannot be read: {exc}") from None
    finally:
        consumer.close()
    return {r: TailEvent(event_id, blocks.get(r)) for r, event_id in found.items()}
