"""KafkaEventSink against a real Kafka broker: manager -> sink -> topic -> consumer.

- 100k mixed events from two engine instances arrive identical and in order per key;
- the broker down when the sink starts and started later: nothing lost within capacity;
- overflow while the broker is down: the in-band drop counts equal exactly what is missing, per
  rank (queue overflow and manager drops; and, with a short ``message.timeout.ms``, failed
  deliveries, whose sequence numbers are the only gaps);
- tiny limits (the topic's ``max.message.bytes``, the producer's ``message.max.bytes``):
  splitting keeps order and content, including Stored events larger than the limit.

The "broker down" tests run their own :class:`~kvevents.broker.LocalBroker` on fixed ports in a
temporary directory (started once to create the topics, then stopped), besides the session's.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from kvevents.consumer.topics import TopicSpec, create_topic
from kvevents.producer import KVCacheEventManager
from kvevents.producer.sink import CONTROL_HEADER, FINGERPRINT_HEADER, KafkaEventSink
from kvevents.schemas import CONTENT_TYPE, current_fingerprint
from sink_helpers import (
    Workload,
    batches_of,
    by_rank,
    consume,
    dropped_by_rank,
    rank_events,
    reassemble,
    wait_for,
)

from kvevents.broker import LocalBroker
from kvevents.broker.config import choose_ports

pytestmark = [pytest.mark.kafka, pytest.mark.slow]

FAST_RECONNECT = {"reconnect.backoff.ms": 50, "reconnect.backoff.max.ms": 500, "log_level": 3}


def test_100k_mixed_events_arrive_identical_and_in_order_per_instance(
    kafka_bootstrap: str, kafka_topic_factory: Callable[..., str]
) -> None:
    topic = kafka_topic_factory(partitions=3)
    config = {"bootstrap.servers": kafka_bootstrap}
    plain = KVCacheEventManager(200_000)
    dp = KVCacheEventManager(100_000, attention_dp_rank=0, attention_dp_size=2, attention_dp_gather=False)
    load_a, load_b = Workload(seed=1), Workload(seed=2, rank=0)
    rank1_events = []
    sink_a = KafkaEventSink(plain, topic, "engine-a", config=config)
    sink_b = KafkaEventSink(dp, topic, "engine-b/dp", config=config)
    total = 0
    while total < 100_000:
        load_a.iteration(plain, 60)
        load_b.iteration(dp, 40)
        events = rank_events(1, 20, seed=len(rank1_events), first_id=len(rank1_events))
        dp.buffer.extend(events)  # what the attention-DP gather does with rank 1's events
        rank1_events += events
        total = len(load_a.expected) + len(load_b.expected) + len(rank1_events)
        time.sleep(0.001)
    for manager in (plain, dp):
        manager.close()
    reports = [sink_a.close(120), sink_b.close(120)]
    stats = [sink_a.stats(), sink_b.stats()]
    assert all(r.clean for r in reports), reports
    assert [s.events_lost_total for s in stats] == [0, 0]
    assert stats[0].events_delivered_total == len(load_a.expected)
    assert stats[1].events_delivered_by_rank == {0: len(load_b.expected), 1: len(rank1_events)}

    consumed = consume(kafka_bootstrap, topic, expect_messages=sum(s.messages_delivered_total for s in stats))
    assert len(consumed) == sum(s.messages_delivered_total for s in stats)
    for sink, expected in ((sink_a, {0: load_a.expected}), (sink_b, {0: load_b.expected, 1: rank1_events})):
        mine = [c for c in consumed if c.batch.instance_id == sink.instance_id]
        assert {c.key for c in mine} == {sink.instance_id.encode()}
        assert len({c.partition for c in mine}) == 1  # one key, one partition: one order
        in_offset_order = sorted(mine, key=lambda c: c.offset)
        headers = {
            "content-type": CONTENT_TYPE.encode(),
            FINGERPRINT_HEADER: current_fingerprint().hex().encode(),
        }
        assert all(c.headers == headers for c in in_offset_order[:-1])
        assert in_offset_order[-1].headers == {**headers, CONTROL_HEADER: b"close"}  # a clean stop says so
        assert in_offset_order[-1].batch.events == []
        in_offset_order = [c.batch for c in sorted(mine, key=lambda c: c.offset)]
        assert [b.sequence for b in in_offset_order] == list(range(len(mine)))
        assert {b.producer_id for b in in_offset_order} == {sink.producer_id}
        assert all(b.dropped == [] for b in in_offset_order)
        assert by_rank(reassemble(in_offset_order)) == expected


# -- a broker that is down at first ---------------------------------------------------------------


@dataclass
class LateBroker:
    broker: LocalBroker
    bootstrap: str
    topics: dict[str, str]


@pytest.fixture(scope="module")
def late_broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LateBroker]:
    """A broker on fixed ports whose topics exist, but which is stopped when a test begins."""
    ports = choose_ports()
    broker = LocalBroker(
        tmp_path_factory.mktemp("late-broker") / "state",
        port=ports.client,
        controller_port=ports.controller,
        stop_with_parent=True,
    )
    broker.start()
    bootstrap = broker.bootstrap_servers
    topics = {name: f"late-{name}" for name in ("down-at-start", "overflow", "timeouts")}
    for topic in topics.values():
        create_topic(bootstrap, TopicSpec(topic, partitions=2))
    broker.stop()
    yield LateBroker(broker, bootstrap, topics)
    broker.stop()


@pytest.fixture
def stopped_broker(late_broker: LateBroker) -> Iterator[LateBroker]:
    late_broker.broker.stop()
    yield late_broker
    late_broker.broker.stop()


def _nothing_answers(bootstrap: str) -> bool:
    from kvevents.broker.probe import metadata_answers

    return not metadata_answers(bootstrap, timeout=0.5)


def test_broker_down_at_start_then_started_loses_nothing_within_capacity(stopped_broker: LateBroker) -> None:
    assert _nothing_answers(stopped_broker.bootstrap)
    topic = stopped_broker.topics["down-at-start"]
    manager = KVCacheEventManager(100_000)
    workload = Workload(seed=21)
    sink = KafkaEventSink(
        manager, topic, "late-engine", config={"bootstrap.servers": stopped_broker.bootstrap, **FAST_RECONNECT},
        topic_config_timeout=1.0,
    )  # fmt: skip
    for _ in range(200):
        workload.iteration(manager, 60)
        time.sleep(0.005)
    assert manager.settle(10)
    assert wait_for(lambda: sink.stats().events_drained_total == len(workload.expected), 10)
    waiting = sink.stats()
    assert waiting.messages_delivered_total == 0 and waiting.events_lost_total == 0
    assert len(workload.expected) > 10_000

    stopped_broker.broker.start()
    assert sink.wait_delivered(120)
    manager.close()
    report = sink.close(30)
    stats = sink.stats()
    assert report.clean and stats.events_lost_total == 0 and stats.manager_drops_by_rank == {}
    assert stats.events_delivered_total == len(workload.expected)
    consumed = consume(stopped_broker.bootstrap, topic, expect_messages=stats.messages_delivered_total)
    batches = batches_of(consumed, "late-engine")
    assert [b.sequence for b in batches] == list(range(stats.messages_produced_total))
    assert reassemble(batches) == workload.expected
    assert dropped_by_rank(batches) == {}


def _feed_four_ranks(manager: KVCacheEventManager, rounds: int) -> tuple[Workload, dict[int, list[Any]]]:
    """Rank 0 through the engine API; ranks 1-3 as the gather hands them over, once with a burst
    larger than the buffer (the manager drops, and counts, the oldest)."""
    workload = Workload(seed=31, rank=0)
    others: dict[int, list[Any]] = {1: [], 2: [], 3: []}
    for round_ in range(rounds):
        workload.iteration(manager, 30)
        for rank, events in others.items():
            count = 6000 if (rank, round_) == (3, rounds // 2) else 15
            new = rank_events(rank, count, seed=round_ * 10 + rank, first_id=len(events))
            manager.buffer.extend(new)
            events += new
        time.sleep(0.005)
    return workload, others


def _check_exact_loss(batches: list[Any], expected: dict[int, list[Any]]) -> dict[int, int]:
    """Per rank: delivered events are the expected ones minus some, in order, and the in-band
    drop counts equal exactly how many are missing. Returns the missing counts."""
    received = by_rank(reassemble(batches))
    reported = dropped_by_rank(batches)
    missing = {}
    for rank, events in expected.items():
        got = received.get(rank, [])
        ids = [e.event_id for e in got]
        assert ids == sorted(ids) and len(set(ids)) == len(ids), f"rank {rank}: out of order or repeated"
        wanted = {e.event_id: e for e in events}
        assert all(wanted[e.event_id] == e for e in got), f"rank {rank}: an event changed on the way"
        missing[rank] = len(events) - len(got)
        assert reported.get(rank, 0) == missing[rank], (
            f"rank {rank}: {missing[rank]} missing, {reported.get(rank, 0)} reported"
        )
    return missing


def test_overflow_while_the_broker_is_down_reports_exactly_what_is_missing(
    stopped_broker: LateBroker,
) -> None:
    topic = stopped_broker.topics["overflow"]
    manager = KVCacheEventManager(
        1000,
        attention_dp_rank=0,
        attention_dp_size=4,
        drop_warning_interval_s=3600,
        attention_dp_gather=False,
    )
    config = {
        "bootstrap.servers": stopped_broker.bootstrap,
        "queue.buffering.max.messages": 5,
        **FAST_RECONNECT,
    }
    sink = KafkaEventSink(
        manager, topic, "overflowing", config=config, topic_config_timeout=1.0, max_queued_events=3000
    )
    workload, others = _feed_four_ranks(manager, rounds=150)
    expected = {0: workload.expected, **others}
    total = sum(len(e) for e in expected.values())
    assert manager.settle(10)
    assert wait_for(
        lambda: sink.stats().events_drained_total + manager.stats().events_dropped_total == total, 20
    )
    during = sink.stats()
    assert during.events_lost_by_reason["queue_full"] > 0 and during.manager_drops_by_rank.get(3, 0) > 0
    assert during.messages_delivered_total == 0

    stopped_broker.broker.start()
    assert sink.wait_delivered(120)
    manager.close()
    report = sink.close(30)
    stats = sink.stats()
    assert report.clean  # every loss was reported in-band by a delivered batch
    consumed = consume(stopped_broker.bootstrap, topic, expect_messages=stats.messages_delivered_total)
    batches = batches_of(consumed, "overflowing")
    assert [b.sequence for b in batches] == list(range(stats.messages_produced_total))  # queue drops: no gaps
    missing = _check_exact_loss(batches, expected)
    sink_lost, manager_lost = stats.events_lost_by_rank, stats.manager_drops_by_rank
    assert missing == {r: sink_lost.get(r, 0) + manager_lost.get(r, 0) for r in expected}
    assert stats.events_lost_by_reason["delivery_failed"] == 0


def test_failed_deliveries_are_reported_in_band_and_are_the_only_sequence_gaps(
    stopped_broker: LateBroker,
) -> None:
    topic = stopped_broker.topics["timeouts"]
    manager = KVCacheEventManager(
        100_000, attention_dp_rank=0, attention_dp_size=4, attention_dp_gather=False
    )
    config = {"bootstrap.servers": stopped_broker.bootstrap, "message.timeout.ms": 1500, **FAST_RECONNECT}
    sink = KafkaEventSink(manager, topic, "timing-out", config=config, topic_config_timeout=0.5)
    workload, others = _feed_four_ranks(manager, rounds=60)
    assert wait_for(lambda: sink.stats().events_lost_by_reason["delivery_failed"] > 0, 20)
    time.sleep(2)  # more time out while the broker stays away
    stopped_broker.broker.start()
    more = Workload(seed=32, rank=0)
    more._next_id = len(workload.expected)  # the same manager goes on numbering
    more._next_hash = 10**12
    for _ in range(20):
        more.iteration(manager, 30)
    assert manager.settle(10) and sink.wait_delivered(120)
    manager.close()
    report = sink.close(30)
    stats = sink.stats()
    assert report.clean
    assert stats.events_lost_by_reason["delivery_failed"] > 0 and stats.messages_failed_total > 0
    assert set(stats.messages_failed_by_error) == {"_MSG_TIMED_OUT"}
    consumed = consume(stopped_broker.bootstrap, topic, expect_messages=stats.messages_delivered_total)
    batches = batches_of(consumed, "timing-out")
    sequences = {b.sequence for b in batches}
    gaps = set(range(stats.messages_produced_total)) - sequences
    assert len(gaps) == stats.messages_failed_total and len(batches) == stats.messages_delivered_total
    _check_exact_loss(batches, {0: workload.expected + more.expected, **others})


# -- splitting under tiny limits ------------------------------------------------------------------


@pytest.mark.parametrize("limited_by", ["topic", "producer"])
def test_tiny_message_limits_keep_order_and_content(
    limited_by: str, kafka_bootstrap: str, kafka_topic_factory: Callable[..., str], tmp_path: Path
) -> None:
    limit = 3000 if limited_by == "topic" else 2000
    topic = (
        kafka_topic_factory(partitions=1, max_message_bytes=limit)
        if limited_by == "topic"
        else kafka_topic_factory()
    )
    config: dict[str, Any] = {"bootstrap.servers": kafka_bootstrap}
    if limited_by == "producer":
        config["message.max.bytes"] = limit
    manager = KVCacheEventManager(100_000)
    workload = Workload(seed=41)
    with KafkaEventSink(manager, topic, "tiny", config=config) as sink:
        for i in range(60):
            workload.iteration(manager, 40)
            if i % 20 == 10:
                workload.huge_stored(manager, blocks=60)  # several times the limit
        manager.close()
        assert sink.wait_delivered(60)
    stats = sink.stats()  # closed: its last message (no events, header kvevents-control: close) counted
    assert stats.message_limit_bytes == limit
    assert stats.events_lost_total == 0 and stats.messages_failed_total == 0
    assert stats.events_split_total >= 3 and stats.fragments_total > 2 * stats.events_split_total
    assert stats.events_delivered_total == len(workload.expected)
    consumed = consume(kafka_bootstrap, topic, expect_messages=stats.messages_delivered_total)
    assert len(consumed) == stats.messages_delivered_total
    assert max(c.size for c in consumed) <= limit
    batches = [c.batch for c in sorted(consumed, key=lambda c: c.offset)]
    assert [b.sequence for b in batches] == list(range(len(batches)))
    assert (
        sum(1 for b in batches if b.first_event_block_offset)
        == stats.fragments_total - stats.events_split_total
    )
    assert reassemble(batches) == workload.expected
