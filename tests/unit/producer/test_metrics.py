"""Producer metrics: the Python object and the Prometheus text exposition, from real stats."""

from __future__ import annotations

import dataclasses
import sys

import prometheus_client  # the metrics extra, part of dev: a missing one fails, never skips
import pytest
from kvevents.producer import GatherStats, KVCacheEventManager
from kvevents.producer.metrics import ProducerMetrics, gather_families, manager_families
from kvevents.producer.sink import KafkaEventSink
from prometheus_client.parser import text_string_to_metric_families
from sink_helpers import Workload, rank_events

MOCK = {"test.mock.num.brokers": 1, "log_level": 3}


@pytest.fixture
def dropping_manager() -> KVCacheEventManager:
    """A rank-0 manager whose buffer (4 x 2 events) dropped 1 of rank 0's and 5 of rank 1's."""
    manager = KVCacheEventManager(
        4, attention_dp_rank=0, attention_dp_size=2, drop_warning_interval_s=3600, attention_dp_gather=False
    )
    manager.buffer.extend(rank_events(0, 1, seed=3))
    manager.buffer.extend(rank_events(1, 7, seed=1))
    manager.buffer.extend(rank_events(0, 3, seed=2))  # drops the oldest: rank 0's first, 2 of rank 1's
    manager.buffer.record_drops(1, 3)  # rank 1 reported 3 drops of its own buffer
    return manager


def test_manager_families_mirror_its_stats(dropping_manager: KVCacheEventManager) -> None:
    stats = dropping_manager.stats()
    families = {f.name: f for f in manager_families(stats)}
    assert families["kvevents_events_dropped_total"].kind == "counter"
    dropped = {
        (s.labels["rank"], s.labels["reason"]): s.value
        for s in families["kvevents_events_dropped_total"].samples
    }
    assert dropped == {("0", "buffer_full"): 1.0, ("1", "buffer_full"): 5.0}
    assert stats.buffer.events_dropped_by_rank == {0: 1, 1: 5}
    assert families["kvevents_buffer_capacity_events"].samples[0].value == 8
    assert families["kvevents_buffer_events"].kind == "gauge"
    dropping_manager.close()


def test_the_python_object_reads_fresh_values(dropping_manager: KVCacheEventManager) -> None:
    metrics = ProducerMetrics(dropping_manager)
    assert metrics.labels == {}
    assert metrics.value("kvevents_events_dropped_total") == 6
    assert metrics.value("kvevents_events_dropped_total", rank="1") == 5
    dropping_manager.buffer.record_drops(3, 10)
    assert metrics.value("kvevents_events_dropped_total", rank="3", reason="buffer_full") == 10
    flat = metrics.as_dict()
    assert flat['kvevents_events_dropped_total{rank="3",reason="buffer_full"}'] == 10
    assert flat["kvevents_buffer_events"] == 8
    dropping_manager.close()
    with pytest.raises(ValueError, match="manager"):
        ProducerMetrics()


def test_sink_metrics_and_their_text_exposition() -> None:
    manager = KVCacheEventManager(
        10_000,
        attention_dp_rank=0,
        attention_dp_size=2,
        drop_warning_interval_s=3600,
        attention_dp_gather=False,
    )
    workload = Workload(seed=4, rank=0)
    sink = KafkaEventSink(manager, "t", "engine-x", config=MOCK, topic_config_timeout=0)
    for _ in range(5):
        workload.iteration(manager, 20)
    manager.buffer.record_drops(1, 7)
    assert manager.settle(10) and sink.wait_delivered(20)
    metrics = ProducerMetrics(manager, sink)
    registry = prometheus_client.CollectorRegistry()
    metrics.register(registry)
    text = prometheus_client.generate_latest(registry).decode()
    stats = sink.stats()

    assert (
        "# TYPE kvevents_events_dropped_total counter" in text
        or "# TYPE kvevents_events_dropped counter" in text
    )
    assert 'kvevents_events_dropped_total{instance_id="engine-x",rank="1",reason="buffer_full"} 7.0' in text
    parsed = {f.name: f for f in text_string_to_metric_families(text)}
    delivered = parsed["kvevents_sink_events_delivered"].samples
    assert [(s.labels, s.value) for s in delivered] == [
        ({"instance_id": "engine-x", "rank": "0"}, len(workload.expected))
    ]
    reported = parsed["kvevents_sink_drops_reported"].samples
    assert [(s.labels["rank"], s.value) for s in reported] == [("1", 7.0)]
    latency = parsed["kvevents_sink_delivery_latency_seconds"]
    assert latency.type == "histogram"
    count = [s.value for s in latency.samples if s.name.endswith("_count")]
    inf = [s.value for s in latency.samples if s.labels.get("le") == "+Inf"]
    assert count == inf == [stats.messages_delivered_total] and count[0] > 0
    buckets = [s.value for s in latency.samples if s.name.endswith("_bucket")]
    assert buckets == sorted(buckets)  # cumulative
    assert parsed["kvevents_sink_queue_capacity_events"].samples[0].value == stats.max_queued_events
    assert parsed["kvevents_events_enqueued"].samples[0].value == manager.stats().events_enqueued_total

    # a second scrape sees new counts: the collector reads fresh snapshots
    manager.buffer.record_drops(1, 1)
    assert sink.wait_delivered(20)
    again = {
        f.name: f
        for f in text_string_to_metric_families(prometheus_client.generate_latest(registry).decode())
    }
    dropped = [s for s in again["kvevents_events_dropped"].samples if s.labels["rank"] == "1"]
    assert [s.value for s in dropped] == [8.0]
    sink.close()
    manager.close()


def test_several_sinks_share_families_told_apart_by_instance_label() -> None:
    registry = prometheus_client.CollectorRegistry()
    with KVCacheEventManager(10) as manager:
        sinks = [KafkaEventSink(manager, "t", f"e{i}", config=MOCK, topic_config_timeout=0) for i in range(2)]
        metrics = ProducerMetrics(manager, sinks[0])
        metrics.add(sink=sinks[1])
        metrics.register(registry)
        with pytest.raises(ValueError, match="Duplicated"):  # one collector per name and registry
            ProducerMetrics(sink=sinks[1]).register(registry)
        text = prometheus_client.generate_latest(registry).decode()
        for sink in sinks:
            sink.close()
    assert text.count("# TYPE kvevents_sink_queue_capacity_events gauge") == 1
    assert 'kvevents_sink_queue_capacity_events{instance_id="e0"}' in text
    assert 'kvevents_sink_queue_capacity_events{instance_id="e1"}' in text
    assert 'kvevents_buffer_capacity_events{instance_id="e0"} 10.0' in text


def test_without_prometheus_client_the_error_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "prometheus_client", None)
    with KVCacheEventManager(10) as manager:
        metrics = ProducerMetrics(manager)
        assert metrics.value("kvevents_buffer_capacity_events") == 10  # the Python side needs nothing
        with pytest.raises(ImportError, match=r"kvevents\[metrics\]"):
            metrics.register()


def test_snapshot_requests_are_metrics() -> None:
    with KVCacheEventManager(10) as manager:
        metrics = ProducerMetrics(manager)
        assert metrics.value("kvevents_snapshot_requested") == 0
        manager.request_snapshot("a test lost events")
        manager.request_snapshot("and again")
        assert metrics.value("kvevents_snapshot_requested") == 1
        assert metrics.value("kvevents_snapshot_requests_total") == 2
        manager.enqueue_snapshot({}, [4])
        assert metrics.value("kvevents_snapshot_requested") == 0
        assert metrics.value("kvevents_snapshots_published_total") == 1


def _gather_stats(rank: int, **counts: object) -> GatherStats:
    fields = {f.name: 0 for f in dataclasses.fields(GatherStats)}
    fields.update(
        attention_dp_rank=rank,
        attention_dp_size=4,
        state="running",
        stop_reason=None,
        ranks_left=(),
        ranks_dead=(),
    )
    fields.update(counts)
    return GatherStats(**fields)  # type: ignore[arg-type]


def test_gather_metrics_per_role() -> None:
    root = {
        f.name: f
        for f in gather_families(
            _gather_stats(0, events_received_total=70, ranks_dead=(2,), resyncs_sent_total=3)
        )
    }
    assert root["kvevents_gather_events_received_total"].samples[0].value == 70
    assert root["kvevents_gather_ranks_dead"].samples[0].value == 1
    assert root["kvevents_gather_resyncs_sent_total"].samples[0].value == 3
    assert "kvevents_gather_events_sent_total" not in root
    other = {f.name: f for f in gather_families(_gather_stats(3, events_sent_total=9, state="stopped"))}
    assert other["kvevents_gather_events_sent_total"].samples[0].labels == {"attention_dp_rank": "3"}
    assert other["kvevents_gather_events_sent_total"].samples[0].value == 9
    assert other["kvevents_gather_running"].samples[0].value == 0
    assert "kvevents_gather_events_received_total" not in other
