"""Checkpoints with real Kafka: restore + catch up equals a full replay (hypothesis over the
checkpoint position), in a file and in a compacted topic; a half-written checkpoint never loads."""

from __future__ import annotations

import struct
import uuid
from pathlib import Path

import msgspec
import pytest
from confluent_kafka import Producer
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kafka_streams import StreamMaker, produce
from kvevents.consumer import (
    CacheIndex,
    Checkpoint,
    CheckpointError,
    EventReader,
    KafkaCheckpointStore,
    load_checkpoint,
    restore,
    save_checkpoint,
)
from kvevents.schemas import EventBatch

pytestmark = pytest.mark.kafka


def full_replay(batches: list[EventBatch]) -> CacheIndex:
    index = CacheIndex()
    for b in batches:
        index.apply(b)
    return index


@pytest.fixture(scope="module")
def events_topic(kafka_bootstrap: str) -> tuple[str, list[EventBatch]]:
    """One 3-partition topic with a 400-batch stream (drops included), shared by the examples."""
    from kvevents.consumer.topics import TopicSpec, create_topic

    name = f"ckpt-events-{uuid.uuid4().hex[:10]}"
    create_topic(kafka_bootstrap, TopicSpec(name, partitions=3))
    batches = StreamMaker(seed=42, instances=5).batches(400)
    produce(kafka_bootstrap, name, batches)
    return name, batches


@pytest.fixture(scope="module")
def store_topic(kafka_bootstrap: str) -> str:
    name = f"ckpt-store-{uuid.uuid4().hex[:10]}"
    KafkaCheckpointStore(kafka_bootstrap, name).create_topic()
    return name


@settings(
    max_examples=12,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    cut=st.integers(0, 400),
    chunk_bytes=st.sampled_from([1024, 4096, 900_000]),
    core=st.sampled_from(["compiled", "python"]),
)
def test_restore_and_catch_up_equals_a_full_replay(
    kafka_bootstrap, events_topic, store_topic, tmp_path_factory, cut, chunk_bytes, core
) -> None:
    topic, batches = events_topic
    expected = full_replay(batches)
    index = CacheIndex(core=core)
    with EventReader(kafka_bootstrap, topic) as reader:
        reader.apply_to(index, until_caught_up=True, max_messages=cut)
        checkpoint = Checkpoint.capture(index, reader)
    assert checkpoint.messages == cut
    path = tmp_path_factory.mktemp("ckpt") / "index.ckpt"
    save_checkpoint(path, checkpoint)
    store = KafkaCheckpointStore(
        kafka_bootstrap, store_topic, name=f"n{uuid.uuid4().hex[:6]}", chunk_bytes=chunk_bytes
    )
    saved = store.save(checkpoint)
    assert saved.chunks == -(-saved.bytes // chunk_bytes)
    for source in (load_checkpoint(path, topic=topic), store.load(topic=topic)):
        assert source == checkpoint
        restored = restore(source, kafka_bootstrap, core=core)
        with restored.reader:
            assert restored.caught_up is not None and restored.caught_up.messages == 400 - cut
            assert restored.index.same_state(expected)
            assert restored.index.degraded_workers() == expected.degraded_workers()


def test_the_latest_checkpoint_wins_and_a_half_written_one_never_loads(
    kafka_bootstrap, events_topic, store_topic
):
    topic, _ = events_topic
    store = KafkaCheckpointStore(kafka_bootstrap, store_topic, name="router-1", chunk_bytes=2048)
    assert store.load() is None
    first = Checkpoint(topic, {0: 1, 1: 2, 2: 3}, CacheIndex().to_bytes())
    with EventReader(kafka_bootstrap, topic) as reader:
        index = CacheIndex()
        reader.apply_to(index)
        second = Checkpoint.capture(index, reader)
    a = store.save(first)
    b = store.save(second)
    assert (a.slot, b.slot) == ("a", "b") and b.chunks > 1
    assert store.load() == second
    # a writer dies half-way through a third checkpoint: some chunks of slot "a", no manifest
    producer = Producer({"bootstrap.servers": kafka_bootstrap})
    half = struct.pack("<16sI", uuid.uuid4().bytes, 0) + b"x" * 100
    producer.produce(store_topic, key=b"router-1/a/0", value=half)
    producer.flush(10)
    assert KafkaCheckpointStore(kafka_bootstrap, store_topic, name="router-1").load() == second
    # a manifest whose chunks are not all there is refused, naming the problem
    bogus = msgspec.msgpack.encode({"id": b"\x01" * 16, "slot": "a", "chunks": 2, "size": 10})
    producer.produce(store_topic, key=b"router-1/manifest", value=bogus)
    producer.flush(10)
    with pytest.raises(CheckpointError, match="chunk 0 of 2: belongs to another checkpoint"):
        KafkaCheckpointStore(kafka_bootstrap, store_topic, name="router-1").load()
    # saving again repairs it: a fresh store finds the slot in use and writes the other
    fresh = KafkaCheckpointStore(kafka_bootstrap, store_topic, name="router-1", chunk_bytes=2048)
    again = fresh.save(second)
    assert again.slot == "b" and fresh.load() == second
    with pytest.raises(CheckpointError, match="not of 'another-topic'"):
        fresh.load(topic="another-topic")


def test_a_checkpoint_bigger_than_the_topic_message_limit_is_chunked(
    kafka_bootstrap, kafka_topic_factory, tmp_path: Path
):
    small = kafka_topic_factory(cleanup_policy="compact", max_message_bytes=16 * 1024)
    store = KafkaCheckpointStore(kafka_bootstrap, small, chunk_bytes=8 * 1024)
    index = CacheIndex()
    for b in StreamMaker(seed=3, instances=4).batches(600):
        index.apply(b)
    checkpoint = Checkpoint("events", {0: 600}, index.to_bytes())
    assert len(checkpoint.index_state) > 4 * 16 * 1024
    saved = store.save(checkpoint)
    assert saved.chunks >= 4 and store.load() == checkpoint
    too_big = KafkaCheckpointStore(kafka_bootstrap, small, name="too-big", chunk_bytes=40 * 1024)
    with pytest.raises(CheckpointError, match="not saved"):
        too_big.save(checkpoint)
    assert too_big.load() is None  # nothing half-written is visible


def test_a_missing_checkpoint_topic_is_a_clear_error(kafka_bootstrap) -> None:
    store = KafkaCheckpointStore(kafka_bootstrap, f"no-such-{uuid.uuid4().hex[:6]}", timeout_s=5)
    with pytest.raises(CheckpointError, match="cannot read checkpoint topic"):
        store.load()
