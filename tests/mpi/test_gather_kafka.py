"""Through the attention-DP gather and rank 0's Kafka sink into a real broker: every event of
every rank is in the topic exactly once, in per-rank order; under overload, per rank, the
events in the topic plus the drops the batches report equal what the rank enqueued.
Programs: ``programs/gather_kafka.py``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from confluent_kafka import Consumer, TopicPartition
from kvevents.schemas import EventBatch, decode_batch

MpiRunner = Callable[..., Any]  # the ``mpirun`` fixture of conftest.py


def read_topic(bootstrap: str, topic: str, timeout: float = 60) -> list[EventBatch]:
    """Every message of the topic's single partition, decoded, in offset order."""
    consumer = Consumer(
        {"bootstrap.servers": bootstrap, "group.id": f"check-{topic}", "enable.auto.commit": False,
         "auto.offset.reset": "earliest"}
    )  # fmt: skip
    try:
        _, high = consumer.get_watermark_offsets(TopicPartition(topic, 0), timeout=10)
        consumer.assign([TopicPartition(topic, 0, 0)])
        batches: list[EventBatch] = []
        while len(batches) < high:
            message = consumer.poll(timeout)
            assert message is not None, f"read {len(batches)} of {high} messages"
            assert message.error() is None, message.error()
            batches.append(decode_batch(message.value()))
        return batches
    finally:
        consumer.close()


def per_rank(batches: list[EventBatch]) -> tuple[dict[int, list[int]], dict[int, int]]:
    ids: dict[int, list[int]] = {}
    drops: dict[int, int] = {}
    for batch in batches:
        for event in batch.events:
            assert event.attention_dp_rank is not None
            ids.setdefault(event.attention_dp_rank, []).append(event.event_id)
        for d in batch.dropped:
            drops[d.attention_dp_rank] = drops.get(d.attention_dp_rank, 0) + d.dropped_events
    return ids, drops


def check_batches_in_sequence(batches: list[EventBatch], size: int) -> None:
    assert len({b.producer_id for b in batches}) == 1
    assert [b.sequence for b in batches] == list(range(len(batches)))
    assert {b.attention_dp_size for b in batches} == {size}
    assert {b.instance_id for b in batches} == {"engine-a"}


@pytest.mark.parametrize("n", [2, 4])
def test_every_event_of_every_rank_reaches_kafka_once_in_order(
    mpirun: MpiRunner, kafka_bootstrap: str, kafka_topic: str, n: int
) -> None:
    run = mpirun(
        "gather_kafka.py", n, "--bootstrap", kafka_bootstrap, "--topic", kafka_topic, "--iterations", "150",
        timeout=120,
    )  # fmt: skip
    run.assert_clean(n)
    batches = read_topic(kafka_bootstrap, kafka_topic)
    check_batches_in_sequence(batches, n)
    ids, drops = per_rank(batches)
    for rank in range(n):
        assert ids[rank] == list(range(run.results[rank]["enqueued"])), rank
    assert drops == {}
    report = run.results[0]["close_report"]
    assert report["undelivered_by_rank"] == {}
    assert report["unreported_by_rank"] == {}


def test_drops_under_overload_reach_kafka_exactly(
    mpirun: MpiRunner, kafka_bootstrap: str, kafka_topic: str
) -> None:
    run = mpirun(
        "gather_kafka.py", 4, "--bootstrap", kafka_bootstrap, "--topic", kafka_topic, "--iterations", "200",
        "--events", "40", "--max-entries", "25", timeout=120,
    )  # fmt: skip
    run.assert_clean(4)
    batches = read_topic(kafka_bootstrap, kafka_topic)
    check_batches_in_sequence(batches, 4)
    ids, drops = per_rank(batches)
    for rank in range(4):
        got = ids.get(rank, [])
        assert got == sorted(set(got)), rank  # once each, in order
        assert drops.get(rank, 0) > 0, rank  # the overload happened and was reported in-band
        assert len(got) + drops.get(rank, 0) == run.results[rank]["enqueued"], rank
    report = run.results[0]["close_report"]
    assert report["undelivered_by_rank"] == {}
    assert report["unreported_by_rank"] == {}
