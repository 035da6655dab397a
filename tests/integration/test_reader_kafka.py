"""EventReader against a real broker: rebuild, live tail, resume, consumer groups, trouble."""

from __future__ import annotations

import threading
import time
import uuid

import pytest
from confluent_kafka import Consumer
from kafka_streams import StreamMaker, produce
from kvevents.consumer import CacheIndex, EventReader, ReaderError, WorkerKey
from kvevents.schemas import BatchLimits, EventBatch, encode_batch

pytestmark = pytest.mark.kafka


def index_of(batches: list[EventBatch]) -> CacheIndex:
    index = CacheIndex()
    for batch in batches:
        index.apply(batch)
    return index


def test_rebuild_reads_every_partition_to_the_watermarks_captured_at_start(
    kafka_bootstrap, kafka_topic_factory
):
    topic = kafka_topic_factory(partitions=3)
    stream = StreamMaker(seed=1)
    early = stream.batches(300)
    produce(kafka_bootstrap, topic, early)
    progress = []
    with EventReader(kafka_bootstrap, topic) as reader:
        assert sum(reader.targets().values()) == 300 and not reader.caught_up
        late = stream.batches(50)
        produce(kafka_bootstrap, topic, late)  # after the start: not part of this rebuild
        index = CacheIndex()
        result = reader.apply_to(index, progress=progress.append, progress_interval_s=0.0)
        assert result.caught_up and result.messages == 300
        assert result.events == sum(len(b.events) for b in early)
        assert result.bytes == sum(len(encode_batch(b)) for b in early)
        assert index.same_state(index_of(early))
        assert progress[-1].fraction == 1.0 and progress[-1].lag == 0 and progress[-1].messages == 300
        assert result.offsets == reader.offsets() and sum(result.offsets.values()) == 300
        # live tail after catching up: the later batches arrive
        tail = reader.apply_to(index, until_caught_up=False, max_messages=50, timeout=30)
        assert tail.messages == 50 and index.same_state(index_of(early + late))
        metrics = reader.metrics()
        assert metrics.messages_total == 350 and metrics.malformed_total == 0 and metrics.lag_total == 0
        assert metrics.overall.events_per_s > 0 and {p.partition for p in metrics.partitions} == {0, 1, 2}


def test_an_empty_topic_is_caught_up_at_once(kafka_bootstrap, kafka_topic):
    with EventReader(kafka_bootstrap, kafka_topic) as reader:
        assert reader.caught_up
        result = reader.apply_to(CacheIndex())
        assert (result.messages, result.caught_up, result.offsets) == (0, True, {0: 0})


def test_live_tail_from_the_end_until_stopped_from_another_thread(kafka_bootstrap, kafka_topic):
    stream = StreamMaker(seed=2, instances=1)
    produce(kafka_bootstrap, kafka_topic, stream.batches(20))  # history the tail does not read
    with EventReader(kafka_bootstrap, kafka_topic, start="end") as reader:
        assert reader.offsets() == {0: 20}
        news = stream.batches(10)
        seen: list[EventBatch] = []

        def stop_when_all_seen() -> None:
            deadline = time.monotonic() + 30
            while len(seen) < 10 and time.monotonic() < deadline:
                time.sleep(0.01)
            reader.stop()

        stopper = threading.Thread(target=stop_when_all_seen)
        stopper.start()
        produce(kafka_bootstrap, kafka_topic, news)
        for batch in reader.batches():  # no until_caught_up: runs until stop()
            seen.append(batch)
        stopper.join()
        assert seen == news and reader.offsets() == {0: 30}


def test_a_live_tail_hands_over_each_message_as_it_arrives_not_at_the_poll_timeout(
    kafka_bootstrap, kafka_topic
):
    stream = StreamMaker(seed=5, instances=1)
    with EventReader(kafka_bootstrap, kafka_topic, start="end", poll_timeout_s=20.0) as reader:
        reader.apply_to(CacheIndex())  # caught up (nothing yet)
        got: list[tuple[float, EventBatch]] = []

        def tail() -> None:  # no message limit: a poll may ask for up to consume_batch messages
            for batch in reader.batches(timeout=60):
                got.append((time.monotonic(), batch))
                break

        thread = threading.Thread(target=tail)
        thread.start()
        time.sleep(1.0)  # the tail is waiting inside its poll
        sent = stream.batches(1)
        produce(kafka_bootstrap, kafka_topic, sent)
        produced = time.monotonic()
        thread.join(30)
        # a batching poll would hold the lone message until 2000 arrive or the 20 s timeout
        assert got and got[0][0] - produced < 5.0 and got[0][1] == sent[0]


def test_resume_from_offsets_equals_reading_everything(kafka_bootstrap, kafka_topic_factory):
    topic = kafka_topic_factory(partitions=2)
    batches = StreamMaker(seed=3).batches(200)
    produce(kafka_bootstrap, topic, batches)
    index = CacheIndex()
    with EventReader(kafka_bootstrap, topic) as first:
        part = first.apply_to(index, max_messages=77, until_caught_up=False)
        assert part.messages == 77 and not part.caught_up
        offsets = first.offsets()
    assert sum(offsets.values()) == 77
    with EventReader(kafka_bootstrap, topic, start=offsets) as second:
        rest = second.apply_to(index)
    assert rest.messages == 123 and index.same_state(index_of(batches))


def test_raw_messages_stopping_early_loses_nothing(kafka_bootstrap, kafka_topic):
    batches = StreamMaker(seed=4, instances=1).batches(30)
    produce(kafka_bootstrap, kafka_topic, batches)
    with EventReader(kafka_bootstrap, kafka_topic, consume_batch=50) as reader:
        first = []
        for message in reader.messages(until_caught_up=True):
            first.append(message.offset())
            if len(first) == 7:
                break  # the other fetched messages stay for the next read
        assert reader.offsets() == {0: 6}  # the 7th was not finished (the loop broke in its body)
        rest = [m.offset() for m in reader.messages(until_caught_up=True)]
    assert first == list(range(7)) and rest == list(range(6, 30))


def test_malformed_messages_are_set_aside_counted_dead_lettered_and_the_reader_goes_on(
    kafka_bootstrap, kafka_topic_factory
):
    topic, dead = kafka_topic_factory(), kafka_topic_factory()
    stream = StreamMaker(seed=5, instances=1)
    good = stream.batches(10)
    items = [*good[:5], (b"inst-0", b"\xc3\x01not avro at all"), (b"inst-0", None), *good[5:]]
    produce(kafka_bootstrap, topic, items)
    seen = []
    with EventReader(kafka_bootstrap, topic, dead_letter_topic=dead, on_malformed=seen.append) as reader:
        index = CacheIndex()
        result = reader.apply_to(index)
        assert result.messages == 12 and result.malformed == 2 and result.caught_up
        assert [(m.offset, m.key) for m in seen] == [(5, b"inst-0"), (6, b"inst-0")]
        assert "truncated" in seen[0].error or "fingerprint" in seen[0].error
        assert "NoneType" in seen[1].error
        assert list(reader.malformed) == seen
        degraded = index.degraded_workers()
        assert degraded and all(w.instance_id == "inst-0" for w in degraded)
        assert any("malformed message" in r for w in degraded for r in index.worker_stats(w).degraded_reasons)
    metrics = reader.metrics()
    assert (metrics.malformed_total, metrics.dead_lettered_total, metrics.dead_letter_failed_total) == (
        2,
        2,
        0,
    )
    consumer = Consumer(
        {"bootstrap.servers": kafka_bootstrap, "group.id": uuid.uuid4().hex, "auto.offset.reset": "earliest"}
    )
    consumer.subscribe([dead])
    copies = []
    deadline = time.monotonic() + 30
    while len(copies) < 2 and time.monotonic() < deadline:
        message = consumer.poll(0.5)
        if message is not None and message.error() is None:
            copies.append(message)
    consumer.close()
    headers = [dict(m.headers()) for m in copies]
    assert [m.value() for m in copies] == [b"\xc3\x01not avro at all", None]
    assert [h["kvevents-source-offset"] for h in headers] == [b"5", b"6"]
    assert all(
        h["kvevents-source-topic"] == topic.encode() and h["kvevents-source-partition"] == b"0"
        for h in headers
    )
    assert headers[0]["kvevents-error"].decode() == seen[0].error


def test_a_batch_beyond_the_limits_is_set_aside_counted_and_dead_lettered(
    kafka_bootstrap, kafka_topic_factory
):
    """Issue 14: the 25-byte message that made 4,194,304 phantom workers is rejected, counted and
    dead-lettered, and the index is what the good messages alone make it."""
    topic, dead = kafka_topic_factory(), kafka_topic_factory()
    good = StreamMaker(seed=6, instances=1).batches(8)
    hostile = encode_batch(EventBatch("inst-0", [], attention_dp_size=2**22, producer_id=1, sequence=99))
    wide = encode_batch(EventBatch("inst-y", [], attention_dp_size=2000))
    produce(kafka_bootstrap, topic, [*good[:4], (b"inst-x", hostile), (b"inst-y", wide), *good[4:]])
    with EventReader(kafka_bootstrap, topic, dead_letter_topic=dead) as reader:
        index = CacheIndex()
        result = reader.apply_to(index)
        assert result.messages == 10 and result.malformed == 2
        assert all("max_attention_dp_size" in m.error for m in reader.malformed)
    assert index.to_bytes() == index_of(good).to_bytes()
    assert reader.metrics().dead_lettered_total == 2
    with EventReader(kafka_bootstrap, topic) as strict:
        assert len(list(strict.batches(until_caught_up=True))) == 8 and strict.malformed_total == 2
    with EventReader(kafka_bootstrap, topic, limits=BatchLimits(max_attention_dp_size=4096)) as roomy:
        assert len(list(roomy.batches(until_caught_up=True))) == 9  # limits are configurable


def test_consumer_group_commits_what_it_processed(kafka_bootstrap, kafka_topic_factory):
    topic = kafka_topic_factory(partitions=2)
    group = f"analytics-{uuid.uuid4().hex[:8]}"
    stream = StreamMaker(seed=6)
    first = stream.batches(40)
    produce(kafka_bootstrap, topic, first)
    with EventReader(kafka_bootstrap, topic, group_id=group) as reader:
        got = list(reader.batches(until_caught_up=True, timeout=60))
        assert reader.caught_up and len(got) == 40
    second = stream.batches(15)
    produce(kafka_bootstrap, topic, second)
    with EventReader(kafka_bootstrap, topic, group_id=group) as reader:
        again = list(reader.batches(until_caught_up=True, timeout=60))
    assert sorted(map(encode_batch, again)) == sorted(map(encode_batch, second))


def test_a_missing_topic_and_an_impossible_offset_are_clear_errors(kafka_bootstrap, kafka_topic):
    with pytest.raises(ReaderError, match="no-such-topic"):
        EventReader(kafka_bootstrap, f"no-such-topic-{uuid.uuid4().hex[:6]}", metadata_timeout_s=5)
    produce(kafka_bootstrap, kafka_topic, StreamMaker(seed=7, instances=1).batches(3))
    with pytest.raises(ReaderError, match="beyond its end"):
        EventReader(kafka_bootstrap, kafka_topic, start={0: 99})
    with pytest.raises(ReaderError, match="not \\[5\\]"):
        EventReader(kafka_bootstrap, kafka_topic, start={5: 0})


def test_lag_per_partition_is_the_watermark_minus_the_position(kafka_bootstrap, kafka_topic):
    produce(kafka_bootstrap, kafka_topic, StreamMaker(seed=8, instances=1).batches(25))
    with EventReader(kafka_bootstrap, kafka_topic) as reader:
        reader.apply_to(CacheIndex(), until_caught_up=False, max_messages=10)
        (state,) = reader.metrics().partitions
        assert (state.position, state.high_watermark, state.lag, state.caught_up) == (10, 25, 15, False)


def test_broker_errors_reach_the_error_callback(kafka_topic):
    errors = []
    with pytest.raises(ReaderError):
        EventReader("127.0.0.1:1", kafka_topic, on_error=errors.append, metadata_timeout_s=3)
    assert errors, "the dead broker was reported to on_error"


def test_degraded_workers_survive_as_keys(kafka_bootstrap, kafka_topic):
    """WorkerKey round trip through the reader's malformed-message marking."""
    batch = StreamMaker(seed=9, instances=1, dp=1).batch("inst-0", events=3)
    produce(kafka_bootstrap, kafka_topic, [batch, (b"inst-0", b"junk")])
    with EventReader(kafka_bootstrap, kafka_topic) as reader:
        index = CacheIndex()
        reader.apply_to(index)
    assert index.degraded_workers() == [WorkerKey("inst-0", 0)]
