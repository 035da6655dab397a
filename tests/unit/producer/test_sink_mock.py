"""KafkaEventSink against librdkafka's mock cluster (and a dead address): envelope, sequence
numbers, loss accounting, re-splitting, callbacks, close. The real broker is tested in
``tests/integration/test_sink_kafka.py``; these are the fast checks of the sink's own logic.

Messages are read back through the ``on_delivery`` callback a caller may put in ``config``
(passed through by the sink): librdkafka hands it each produced message with its bytes.
"""

from __future__ import annotations

import concurrent.futures
import socket
import threading
import time
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
from confluent_kafka import KafkaException
from kvevents.consumer import CacheIndex
from kvevents.producer import KVCacheEventManager
from kvevents.producer.sink import KafkaEventSink
from kvevents.producer.sink_queue import LOSS_REASONS
from kvevents.schemas import EventBatch, KVCacheCreatedData, KVCacheEvent, RankDrops, decode_batch
from sink_helpers import Workload, by_rank, huge_stored_event, rank_events, reassemble, wait_for

MOCK = {"test.mock.num.brokers": 1, "log_level": 3}


class Captured:
    """Collects what librdkafka reports for each message (the config's ``on_delivery``)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.messages: list[tuple[Any, bytes, bytes, dict[str, bytes]]] = []

    def __call__(self, err: Any, msg: Any) -> None:
        with self.lock:
            self.messages.append((err, msg.value(), msg.key(), dict(msg.headers() or [])))

    def delivered(self) -> list[EventBatch]:
        with self.lock:
            batches = [decode_batch(value) for err, value, _, _ in self.messages if err is None]
        return sorted(batches, key=lambda b: b.sequence)


@pytest.fixture
def dead_address() -> Iterator[str]:
    """An address where nothing listens (connections are refused)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    yield f"127.0.0.1:{port}"


def mock_sink(manager: Any, captured: Captured, **kwargs: Any) -> KafkaEventSink:
    config = {**MOCK, "on_delivery": captured, **kwargs.pop("config", {})}
    kwargs.setdefault("topic_config_timeout", 0)
    return KafkaEventSink(manager, "kv-events", "engine-a", config=config, **kwargs)


def test_batches_carry_the_envelope_and_sequence_without_gaps() -> None:
    captured = Captured()
    workload = Workload(seed=3)
    reports = []
    started_us = time.time_ns() // 1000
    with (
        KVCacheEventManager(100_000) as manager,
        mock_sink(manager, captured, on_delivery=reports.append) as sink,
    ):
        for _ in range(40):
            workload.iteration(manager, 25)
            time.sleep(0.002)
        assert manager.settle(10)
        assert sink.wait_delivered(30)
    stats = sink.stats()  # closed: its last message (no events, header kvevents-control: close) counted
    batches = captured.delivered()
    assert batches[-1].events == []
    assert len(batches) == stats.messages_delivered_total == stats.messages_produced_total > 1
    assert [b.sequence for b in batches] == list(range(len(batches)))
    assert {b.producer_id for b in batches} == {sink.producer_id} and 0 < sink.producer_id < 2**63
    assert all(b.instance_id == "engine-a" and b.attention_dp_size == 1 and b.dropped == [] for b in batches)
    assert all(started_us <= b.created_at_us <= time.time_ns() // 1000 for b in batches)
    assert reassemble(batches) == workload.expected
    assert {key for _, _, key, _ in captured.messages} == {b"engine-a"}  # headers: the real-broker test
    assert stats.events_delivered_total == stats.events_drained_total == len(workload.expected)
    assert stats.events_delivered_by_rank == {0: len(workload.expected)}
    assert stats.bytes_delivered_total == sum(len(v) for _, v, _, _ in captured.messages)
    assert stats.delivery_latency.count == len(batches) and stats.events_lost_total == 0
    # the per-message reports agree with the messages
    assert sorted(r.sequence for r in reports) == list(range(len(batches)))
    assert sum(r.events for r in reports) == len(workload.expected)
    assert all(r.delivered and r.latency_s >= 0 and r.acked_at >= r.produced_at for r in reports)
    assert max(r.last_event_id_by_rank[0] for r in reports if r.events) == workload.expected[-1].event_id


def test_a_sink_that_keeps_up_encodes_each_message_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """With nothing queued, chunks are encoded with the envelope they are produced with, so no
    message is framed again at hand-off (the splice costs a copy of the message)."""
    from kvevents.producer.sink_chunks import EnvelopeWriter

    framed = []
    original = EnvelopeWriter.message
    monkeypatch.setattr(
        EnvelopeWriter, "message", lambda self, *a, **k: framed.append(1) or original(self, *a, **k)
    )
    captured = Captured()
    workload = Workload(seed=9)
    with KVCacheEventManager(10_000) as manager, mock_sink(manager, captured) as sink:
        for _ in range(20):
            workload.iteration(manager, 20)
            assert manager.settle(5) and sink.wait_delivered(10)
        stats = sink.stats()
        assert framed == []  # (closing frames one more message: the close batch)
    assert stats.messages_delivered_total >= 20
    assert reassemble(captured.delivered()) == workload.expected


@pytest.mark.parametrize("idempotent", [True, False])
def test_an_idempotent_sink_waits_while_librdkafkas_window_is_full(
    monkeypatch: pytest.MonkeyPatch, idempotent: bool
) -> None:
    """librdkafka's idempotent producer sends nothing more while IDEMPOTENT_WINDOW messages are
    unacknowledged (and with linger.ms=0 spins until an ack): the sink keeps what it drains
    meanwhile, and hands all of it over once an acknowledgement makes room, as librdkafka would
    send it. Acknowledgements are held back here until the test lets them through."""
    from kvevents.producer import sink as sink_module
    from kvevents.producer.sink_config import IDEMPOTENT_WINDOW

    produced: list[int] = []
    held: list[Any] = []
    lock = threading.Lock()
    holding = threading.Event()
    holding.set()

    class AcksOnRelease(sink_module.Producer):  # type: ignore[misc]  # librdkafka's type, untyped
        def produce(self, *args: Any, on_delivery: Any = None, **kwargs: Any) -> None:
            def hold(err: Any, msg: Any) -> None:
                with lock:
                    if holding.is_set():
                        held.append(lambda: on_delivery(err, msg))
                        return
                on_delivery(err, msg)

            produced.append(len(produced))
            super().produce(*args, on_delivery=hold, **kwargs)

    def release(count: int) -> None:
        with lock:
            callbacks, held[:count] = held[:count], []
        for callback in callbacks:
            callback()

    monkeypatch.setattr(sink_module, "Producer", AcksOnRelease)
    captured = Captured()
    workload = Workload(seed=12)
    window = IDEMPOTENT_WINDOW
    with (
        KVCacheEventManager(100_000) as manager,
        mock_sink(manager, captured, config={"enable.idempotence": idempotent}) as sink,
    ):
        for i in range(2 * window):  # one drain each: the sink loops every 10 ms while it waits
            workload.iteration(manager, 5)
            assert manager.settle(5)
            assert wait_for(lambda: sink.stats().events_drained_total == len(workload.expected), 5)
            expected = min(i + 1, window) if idempotent else i + 1
            assert wait_for(lambda want=expected: len(produced) == want, 5), (i, len(produced))
        time.sleep(0.05)
        if idempotent:
            assert len(produced) == window and sink.stats().queued_messages == window
            assert wait_for(lambda: len(held) == window, 5)
            release(1)  # one acknowledgement: room for all that waited
            assert wait_for(lambda: len(produced) == 2 * window, 5), len(produced)
            assert sink.stats().queued_messages == 0
        assert len(produced) == 2 * window
        assert wait_for(lambda: len(held) == len(produced) - (1 if idempotent else 0), 5)
        with lock:
            holding.clear()  # from now on acknowledgements pass (the close batch's too)
        release(len(held))
        assert sink.wait_delivered(10)
    batches = captured.delivered()
    assert [b.sequence for b in batches] == list(range(len(batches)))
    assert reassemble(batches) == workload.expected


def test_every_sink_draws_its_own_producer_id() -> None:
    with KVCacheEventManager(10) as manager:
        sinks = [mock_sink(manager, Captured()) for _ in range(2)]
        ids = {s.producer_id for s in sinks}
        for s in sinks:
            s.close()
    assert len(ids) == 2


def test_the_manager_drops_travel_in_band_even_without_events() -> None:
    captured = Captured()
    manager = KVCacheEventManager(
        10, attention_dp_rank=0, attention_dp_size=4, drop_warning_interval_s=3600, attention_dp_gather=False
    )
    with mock_sink(manager, captured) as sink:
        manager.buffer.record_drops(2, 5)  # what the gather does with rank 2's reported drops
        assert sink.wait_delivered(10)
        manager.buffer.extend(rank_events(3, 50, seed=1))  # 40 dropped at once: capacity is 10 x 4
        assert sink.wait_delivered(10)
        stats = sink.stats()
    manager.close()
    batches = captured.delivered()
    assert batches[0].events == [] and batches[0].dropped == [RankDrops(2, 5)]
    assert all(b.attention_dp_size == 4 for b in batches)
    assert sum(len(b.events) for b in batches) == 40
    assert stats.manager_drops_by_rank == {2: 5, 3: 10} == stats.drops_reported_by_rank
    assert {d.attention_dp_rank: d.dropped_events for b in batches[1:] for d in b.dropped} == {3: 10}
    assert stats.drops_pending_by_rank == {}


def test_queue_overflow_while_kafka_is_away_is_counted_per_rank_and_reported_at_close(
    dead_address: str,
) -> None:
    manager = KVCacheEventManager(
        100_000, attention_dp_rank=0, attention_dp_size=3, attention_dp_gather=False
    )
    config = {
        "bootstrap.servers": dead_address,
        "queue.buffering.max.messages": 2,  # librdkafka holds two messages, the sink's queue the rest
        "reconnect.backoff.max.ms": 200,
        "log_level": 0,
    }
    sink = KafkaEventSink(
        manager, "kv-events", "engine-b", config=config, topic_config_timeout=0, max_queued_events=60
    )
    pushed = {0: 0, 1: 0, 2: 0}
    for round_ in range(30):
        for rank in range(3):
            events = rank_events(rank, 7, seed=round_ * 3 + rank, first_id=round_ * 7)
            manager.buffer.extend(events)
            pushed[rank] += len(events)
        time.sleep(0.01)  # separate drains: separate chunks
    assert wait_for(lambda: sink.stats().events_drained_total == 630, 10)
    stats = sink.stats()
    assert stats.messages_produced_total == 2 and stats.in_flight_messages == 2
    assert stats.queued_events <= 60 or stats.queued_messages == 1  # the newest chunk always stays
    lost = stats.events_lost_by_rank
    assert stats.events_lost_by_reason["queue_full"] == sum(lost.values()) > 400
    # every drained event is in exactly one place
    assert stats.queued_events + stats.in_flight_events + sum(lost.values()) == 630

    assert not sink.wait_delivered(0.2)  # nothing gets through: it says so when the time is up
    report = sink.close(timeout=0.5)
    final = sink.stats()
    manager.close()
    assert report.messages_purged == 2
    assert final.events_delivered_total == 0 and final.events_lost_by_reason["unsent_at_close"] > 0
    # nothing delivered: every event is lost, per rank exactly, and none of it was reported in-band
    assert final.events_lost_by_rank == pushed == report.unreported_by_rank
    undelivered = {rank: pushed[rank] - lost.get(rank, 0) for rank in pushed}
    assert report.undelivered_by_rank == undelivered
    assert set(final.events_lost_by_reason) == set(LOSS_REASONS)


def test_events_the_sink_loses_ask_the_engine_for_a_snapshot(dead_address: str) -> None:
    config = {"bootstrap.servers": dead_address, "queue.buffering.max.messages": 1, "log_level": 0}
    with KVCacheEventManager(100_000) as manager:
        reasons: list[str] = []
        manager.add_snapshot_listener(reasons.append)
        sink = KafkaEventSink(
            manager, "kv-events", "engine-s", config=config, topic_config_timeout=0, max_queued_events=20
        )
        assert not manager.snapshot_requested
        for round_ in range(10):
            manager.buffer.extend(rank_events(0, 7, seed=round_, first_id=round_ * 7))
            time.sleep(0.01)
        assert wait_for(lambda: sink.stats().events_lost_by_reason["queue_full"] > 0, 10)
        assert manager.snapshot_requested
        assert reasons == [manager.snapshot_request_reason]
        assert "lost by the Kafka sink (queue_full)" in reasons[0]
        sink.close(timeout=0.2)


def test_failed_deliveries_are_counted_per_rank_and_stay_pending(dead_address: str) -> None:
    manager = KVCacheEventManager(
        100_000, attention_dp_rank=0, attention_dp_size=2, attention_dp_gather=False
    )
    config = {"bootstrap.servers": dead_address, "message.timeout.ms": 300, "log_level": 0}
    failures = []
    sink = KafkaEventSink(
        manager, "kv-events", "engine-c", config=config, topic_config_timeout=0,
        on_delivery=lambda r: failures.append(r) if not r.delivered else None,
    )  # fmt: skip
    manager.buffer.extend(rank_events(0, 10, seed=1) + rank_events(1, 4, seed=2))
    assert wait_for(lambda: sink.stats().events_lost_by_reason["delivery_failed"] == 14, 10)
    stats = sink.stats()
    assert stats.events_lost_by_rank == {0: 10, 1: 4} == stats.drops_pending_by_rank
    assert stats.messages_failed_by_error.get("_MSG_TIMED_OUT", 0) >= 1
    assert failures[0].error.name() == "_MSG_TIMED_OUT" and failures[0].events_by_rank == {0: 10, 1: 4}
    report = sink.close(timeout=0.5)
    manager.close()
    assert report.unreported_by_rank == {0: 10, 1: 4}
    assert report.undelivered_by_rank == {}  # they failed before close, not at it


class GatedDescribeSink(KafkaEventSink):
    """A sink whose topic describe answers only when the test says so."""

    def _start_topic_describe(self, timeout: float) -> None:
        self.answer: concurrent.futures.Future[dict[str, Any]] = concurrent.futures.Future()
        self._describe = (None, self.answer, time.monotonic() + 60)


def test_chunks_made_before_the_topic_limit_was_known_are_cut_again() -> None:
    captured = Captured()
    manager = KVCacheEventManager(100_000)
    workload = Workload(seed=5)
    for _ in range(10):
        workload.iteration(manager, 30)
    assert manager.settle(10)
    manager.buffer.extend(
        [huge_stored_event(workload.expected[-1].event_id + 1, blocks=40, tokens_per_block=32)]
    )
    expected = [*workload.expected, *manager.buffer.take(0)]
    manager.buffer.extend(expected)
    sink = GatedDescribeSink(manager, "kv", "engine-d", config={**MOCK, "on_delivery": captured})
    assert wait_for(lambda: sink.stats().queued_events == len(expected), 10)
    assert sink.stats().queued_messages == 1  # one chunk under message.max.bytes, the only limit known
    assert sink.stats().messages_produced_total == 0  # nothing is produced before the limit is known
    sink.answer.set_result({"max.message.bytes": SimpleNamespace(value="3000")})
    assert sink.wait_delivered(30)
    stats = sink.stats()
    report = sink.close()
    manager.close()
    assert report.clean
    assert (stats.topic_max_message_bytes, stats.message_limit_bytes) == (3000, 3000)
    assert int(sink.config["batch.size"]) <= 3000  # the producer was remade to pack smaller requests
    assert all(len(value) <= 3000 for _, value, _, _ in captured.messages)
    assert stats.events_split_total >= 1 and stats.events_lost_total == 0
    assert reassemble(captured.delivered()) == expected
    assert stats.events_delivered_total == len(expected)


def test_a_loss_after_a_queued_chunk_is_not_reported_before_that_chunks_events() -> None:
    """CI, 2026-12-07: rank 0's first chunk (Created, ids 0-4) waited for the topic's limit
    while the buffer dropped its later events (5-14, its last); the first batch then carried
    those drops, which a consumer applies before the batch's events, so the Created event
    "rebuilt" the worker and the loss was invisible. Now a later batch carries them."""
    captured = Captured()
    manager = KVCacheEventManager(
        10, attention_dp_rank=0, attention_dp_size=2, drop_warning_interval_s=3600, attention_dp_gather=False
    )  # holds 10 x 2 events
    first = [KVCacheEvent(0, KVCacheCreatedData([100, 0]), 32, 0), *rank_events(0, 4, seed=2, first_id=1)]
    manager.buffer.extend(first)
    sink = GatedDescribeSink(manager, "kv", "engine-e", config={**MOCK, "on_delivery": captured})
    assert wait_for(lambda: sink.stats().queued_events == 5, 10)
    later = [*rank_events(0, 10, seed=3, first_id=5), *rank_events(1, 30, seed=4)]
    manager.buffer.extend(later)  # 20 dropped: rank 0's 10 (its last) and rank 1's first 10
    assert wait_for(lambda: sink.stats().queued_events == 25, 10)
    sink.answer.set_result({"max.message.bytes": SimpleNamespace(value="1000000")})
    assert sink.wait_delivered(30)
    sink.close()
    manager.close()
    batches = captured.delivered()
    assert batches[0].events == first and batches[0].dropped == []
    assert [d for b in batches for d in b.dropped] == [RankDrops(0, 10), RankDrops(1, 10)]
    index = CacheIndex()
    for batch in batches:
        index.apply(batch)
    assert {w.attention_dp_rank for w in index.degraded_workers()} == {0, 1}


def test_a_chunk_dropped_from_the_queue_is_reported_by_the_queues_next_chunk() -> None:
    """The sink's queue drops its oldest chunk; every chunk still queued holds newer events, so
    the first batch produced carries the loss (not a batch queued later, or one with no events
    once the queue is empty)."""
    captured = Captured()
    manager = KVCacheEventManager(100, attention_dp_rank=0, attention_dp_size=2, attention_dp_gather=False)
    oldest, newer = rank_events(1, 6, seed=8), rank_events(1, 6, seed=9, first_id=6)
    manager.buffer.extend(oldest)
    sink = GatedDescribeSink(
        manager, "kv", "engine-f", config={**MOCK, "on_delivery": captured}, max_queued_events=10
    )
    assert wait_for(lambda: sink.stats().queued_events == 6, 10)
    manager.buffer.extend(newer)  # 12 queued > 10: the oldest chunk goes
    assert wait_for(lambda: sink.stats().queued_events == 6 and sink.stats().events_lost_total == 6, 10)
    sink.answer.set_result({"max.message.bytes": SimpleNamespace(value="1000000")})
    assert sink.wait_delivered(30)
    report = sink.close()
    manager.close()
    batches = captured.delivered()
    assert batches[0].events == newer and batches[0].dropped == [RankDrops(1, 6)]
    assert [d for b in batches for d in b.dropped] == [RankDrops(1, 6)] and report.unreported_by_rank == {}


def test_gathered_drops_behind_that_ranks_buffered_events_are_reported_after_them() -> None:
    """Rank 1's first events (Created first) wait in rank 0's buffer when the gather reports
    that rank 1 dropped later ones: the batch with the older events must not carry the drops."""
    captured = Captured()
    manager = KVCacheEventManager(
        100, attention_dp_rank=0, attention_dp_size=2, drop_warning_interval_s=3600, attention_dp_gather=False
    )
    older = [KVCacheEvent(0, KVCacheCreatedData([100, 0]), 32, 1), *rank_events(1, 4, seed=6, first_id=1)]
    newer = rank_events(1, 3, seed=7, first_id=10)
    manager.buffer.extend(older)
    manager.buffer.record_drops(1, 5, notify=False)  # as the gather does with rank 1's report
    manager.buffer.extend(newer)
    with mock_sink(manager, captured) as sink:
        assert sink.wait_delivered(10)
    manager.close()
    batches = captured.delivered()
    assert batches[0].events == older and batches[0].dropped == []
    assert batches[1].events == newer and batches[1].dropped == [RankDrops(1, 5)]
    index = CacheIndex()
    for batch in batches:
        index.apply(batch)
    assert {w.attention_dp_rank for w in index.degraded_workers()} == {1}


def test_a_stopping_sink_drains_past_every_drop_mark() -> None:
    captured = Captured()
    manager = KVCacheEventManager(100, attention_dp_rank=0, attention_dp_size=3, attention_dp_gather=False)
    expected = []
    for k in range(20):  # 20 reports behind buffered events: the buffer's drains come in 21 parts
        events = rank_events(1 + k % 2, 2, seed=k, first_id=2 * k)
        manager.buffer.extend(events)
        manager.buffer.record_drops(1 + k % 2, 1, notify=False)
        expected += events
    sink = mock_sink(manager, captured)
    assert sink.wait_delivered(10)  # one pass of the sink takes every part
    assert sink.stats().events_delivered_total == len(expected) and len(manager.buffer) == 0
    report = sink.close()
    manager.close()
    batches = captured.delivered()
    assert [e for b in batches for e in b.events] == expected
    assert sum(d.dropped_events for b in batches for d in b.dropped) == 20 and report.unreported_by_rank == {}


def test_close_takes_what_the_manager_still_holds_and_is_idempotent() -> None:
    captured = Captured()
    manager = KVCacheEventManager(1000)
    sink = mock_sink(manager, captured)
    workload = Workload(seed=8)
    workload.iteration(manager, 50)
    manager.close()  # the engine side stops first
    report = sink.close(timeout=10)
    assert report.clean and report.messages_purged == 0
    assert sink.close() is report and sink.closed
    assert reassemble(captured.delivered()) == workload.expected


def test_the_attention_dp_size_comes_from_the_manager_or_the_caller() -> None:
    with KVCacheEventManager(
        10, attention_dp_rank=0, attention_dp_size=8, attention_dp_gather=False
    ) as manager:
        with mock_sink(manager, Captured()) as sink:
            assert sink.attention_dp_size == 8
        with mock_sink(manager, Captured(), attention_dp_size=2) as sink:
            assert sink.attention_dp_size == 2
    with KVCacheEventManager(10) as manager, mock_sink(manager, Captured()) as sink:
        assert sink.attention_dp_size == 1


def test_bad_arguments_are_named() -> None:
    with KVCacheEventManager(10) as manager:
        with pytest.raises(TypeError, match="drain"):
            KafkaEventSink(object(), "t", "i", config=MOCK)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="topic"):
            KafkaEventSink(manager, "", "i", config=MOCK)
        with pytest.raises(ValueError, match="instance_id"):
            KafkaEventSink(manager, "t", "", config=MOCK)
        with pytest.raises(ValueError, match="attention_dp_size"):
            KafkaEventSink(manager, "t", "i", config=MOCK, attention_dp_size=0)
        with pytest.raises(ValueError, match="max_events"):
            KafkaEventSink(manager, "t", "i", config=MOCK, max_queued_events=0)
        with pytest.raises(ValueError, match="max_events_per_message"):
            KafkaEventSink(manager, "t", "i", config=MOCK, max_events_per_message=0)
        with pytest.raises(ValueError, match="topic_config_timeout"):
            KafkaEventSink(manager, "t", "i", config=MOCK, topic_config_timeout=None)  # type: ignore[arg-type]
        with pytest.raises(KafkaException, match="acks"):  # librdkafka's own check, at once
            KafkaEventSink(manager, "t", "i", config={**MOCK, "acks": "sometimes"})


def test_settings_pass_through_and_the_callers_callbacks_are_chained(dead_address: str) -> None:
    errors: list[Any] = []
    stats_json: list[str] = []
    config = {
        "bootstrap.servers": dead_address,
        "error_cb": errors.append,
        "stats_cb": stats_json.append,
        "statistics.interval.ms": 100,
        "client.id": "my-engine",
        "linger.ms": 17,
        "reconnect.backoff.max.ms": 100,
        "log_level": 0,
    }
    with (
        KVCacheEventManager(10) as manager,
        KafkaEventSink(manager, "t", "i", config=config, topic_config_timeout=0) as sink,
    ):
        assert wait_for(lambda: errors and stats_json and sink.stats().librdkafka, 10)
        seen = len(errors)  # the sink counts each error before the caller's callback sees it
        stats = sink.stats()
        effective = sink.config
    assert effective["client.id"] == "my-engine" and effective["linger.ms"] == 17
    assert effective["enable.idempotence"] is True and "error_cb" not in effective
    assert {e.name() for e in errors} & {"_TRANSPORT", "_ALL_BROKERS_DOWN"}
    assert sum(stats.errors_by_code.values()) >= seen > 0
    assert "msg_cnt" in stats.librdkafka


def test_the_confluent_framing_with_a_registry_codec() -> None:
    from kvevents.schemas.registry import RegistryCodec

    captured = Captured()
    codec = RegistryCodec("mock://sink-registry", topic="kv-events")
    workload = Workload(seed=11)
    with KVCacheEventManager(10_000) as manager, mock_sink(manager, captured, codec=codec) as sink:
        for _ in range(5):
            workload.iteration(manager, 20)
        assert manager.settle(10) and sink.wait_delivered(20)
    values = [value for err, value, _, _ in captured.messages if err is None]
    assert values and all(v[0] == 0 for v in values)
    batches = sorted((codec.decode_batch(v) for v in values), key=lambda b: b.sequence)
    assert reassemble(batches) == workload.expected
    assert by_rank(workload.expected).keys() == {0}
