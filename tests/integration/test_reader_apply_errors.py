"""EventReader against a real broker when applying a message fails: a full index (the batch is
rejected whole, counted, dead-lettered naming the cap) and an unexpected exception (set aside
with its text; the reader goes on), on both index cores."""

from __future__ import annotations

import time
import uuid

import pytest
from confluent_kafka import Consumer
from kafka_streams import produce
from kvevents.consumer import CacheIndex, EventReader
from kvevents.schemas import (
    BatchLimits,
    EventBatch,
    KVCacheEvent,
    KVCacheStoredBlockData,
    KVCacheStoredData,
    encode_batch,
)

pytestmark = pytest.mark.kafka

CORES = ["python", "compiled"]


def _stored(seq: int, window: int, instance: str = "inst-0") -> EventBatch:
    block = KVCacheStoredBlockData(100 + seq, [seq, seq + 1, seq + 2, seq + 3])  # type: ignore[arg-type]
    event = KVCacheEvent(seq, KVCacheStoredData(None, [block]), window, 0)
    return EventBatch(instance, [event], producer_id=3, sequence=seq)


def _dead_letters(bootstrap: str, topic: str, expected: int) -> list[dict[str, bytes]]:
    consumer = Consumer(
        {"bootstrap.servers": bootstrap, "group.id": uuid.uuid4().hex, "auto.offset.reset": "earliest"}
    )
    consumer.subscribe([topic])
    headers: list[dict[str, bytes]] = []
    deadline = time.monotonic() + 30
    while len(headers) < expected and time.monotonic() < deadline:
        message = consumer.poll(0.5)
        if message is not None and message.error() is None:
            headers.append(dict(message.headers() or []))
    consumer.close()
    return headers


@pytest.mark.parametrize("core", CORES)
def test_a_batch_beyond_the_index_cap_is_rejected_whole_and_dead_lettered(
    core: str, kafka_bootstrap: str, kafka_topic_factory
) -> None:
    topic, dead = kafka_topic_factory(), kafka_topic_factory()
    batches = [_stored(0, 64), _stored(1, 128), _stored(2, 64)]
    produce(kafka_bootstrap, topic, [(b"inst-0", encode_batch(b)) for b in batches])
    index = CacheIndex(core=core, limits=BatchLimits(max_caches=1))
    with EventReader(kafka_bootstrap, topic, dead_letter_topic=dead) as reader:
        result = reader.apply_to(index)
        assert result.messages == 3 and result.malformed == 1 and result.caught_up
        (rejected,) = reader.malformed
        assert rejected.offset == 1 and "BatchLimits.max_caches" in rejected.error
    assert reader.metrics().dead_lettered_total == 1
    (worker,) = index.workers()
    stats = index.worker_stats(worker)
    assert set(stats.windows) == {64} and stats.windows[64].blocks == 2 and stats.degraded
    (headers,) = _dead_letters(kafka_bootstrap, dead, 1)
    assert headers["kvevents-source-offset"] == b"1"
    assert b"BatchLimits.max_caches" in headers["kvevents-error"]


class _FailsOnce(CacheIndex):
    """An index whose apply raises a bug-like exception for one instance's messages."""

    def apply_encoded(self, data: bytes | bytearray | memoryview) -> None:
        if b"explodes" in bytes(data):
            raise KeyError("a bug in the apply path")
        super().apply_encoded(data)


@pytest.mark.parametrize("core", CORES)
def test_an_unexpected_exception_from_apply_is_set_aside_and_the_reader_goes_on(
    core: str, kafka_bootstrap: str, kafka_topic_factory
) -> None:
    topic, dead = kafka_topic_factory(), kafka_topic_factory()
    items = [
        (b"inst-0", encode_batch(_stored(0, 64))),
        (b"explodes", encode_batch(_stored(0, 64, instance="explodes"))),
        (b"inst-0", encode_batch(_stored(1, 64))),
    ]
    produce(kafka_bootstrap, topic, items)
    index = _FailsOnce(core=core)
    with EventReader(kafka_bootstrap, topic, dead_letter_topic=dead) as reader:
        result = reader.apply_to(index)
        assert result.messages == 3 and result.malformed == 1 and result.caught_up
        (failed,) = reader.malformed
        assert failed.offset == 1 and failed.key == b"explodes"
        assert "KeyError" in failed.error and "a bug in the apply path" in failed.error
    assert [w.instance_id for w in index.workers()] == ["inst-0"]
    assert index.stats().counters["events_applied"] == 2
    (headers,) = _dead_letters(kafka_bootstrap, dead, 1)
    assert b"a bug in the apply path" in headers["kvevents-error"]


class _OutOfMemory(CacheIndex):
    def apply_encoded(self, data: bytes | bytearray | memoryview) -> None:
        raise MemoryError


def test_memory_errors_still_stop_the_reader(kafka_bootstrap: str, kafka_topic: str) -> None:
    produce(kafka_bootstrap, kafka_topic, [(b"inst-0", encode_batch(_stored(0, 64)))])
    with EventReader(kafka_bootstrap, kafka_topic) as reader, pytest.raises(MemoryError):
        reader.apply_to(_OutOfMemory())
