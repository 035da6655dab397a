"""The producer's counters and gauges: as a Python object, and as Prometheus metrics.

:class:`ProducerMetrics` reads a manager's and a sink's ``stats()`` when asked and turns them
into :class:`MetricFamily` objects, which also feed Prometheus through a custom collector
(``prometheus_client``, the ``metrics`` extra, is imported only by :meth:`ProducerMetrics.register`
and :meth:`ProducerMetrics.collector`). The metrics and their labels: ``docs/OPERATIONS.md``.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from .sink_stats import SinkStats
from .stats import ManagerStats

if TYPE_CHECKING:
    from .gather import GatherStats
    from .manager import KVCacheEventManager
    from .sink import KafkaEventSink

__all__ = [
    "MetricFamily",
    "ProducerMetrics",
    "PrometheusCollector",
    "Sample",
    "gather_families",
    "manager_families",
    "sink_families",
]

Kind = Literal["counter", "gauge", "histogram"]


@dataclass(frozen=True, slots=True)
class Sample:
    """One value of a family, with its labels. Histogram samples carry ``buckets`` (upper bound
    as Prometheus writes it, cumulative count; ``+Inf`` last) and ``value`` is their sum."""

    labels: dict[str, str]
    value: float
    buckets: tuple[tuple[str, float], ...] = ()


@dataclass(frozen=True, slots=True)
class MetricFamily:
    """A named metric: counters' names end in ``_total``, as Prometheus exposes them."""

    name: str
    kind: Kind
    help: str
    samples: list[Sample] = field(default_factory=list)


class _Families:
    """Collects families in order, merging samples of the same name."""

    def __init__(self, labels: Mapping[str, str]) -> None:
        self.labels = dict(labels)
        self._by_name: dict[str, MetricFamily] = {}

    def add(self, name: str, kind: Kind, help_: str, value: float, **labels: object) -> None:
        family = self._by_name.get(name)
        if family is None:
            family = self._by_name[name] = MetricFamily(name, kind, help_)
        family.samples.append(Sample({**self.labels, **{k: str(v) for k, v in labels.items()}}, float(value)))

    def add_each(
        self, name: str, kind: Kind, help_: str, label: str, values: Mapping[Any, int], **labels: object
    ) -> None:
        """One sample per ``values`` item (the family exists even when ``values`` is empty)."""
        family = self._by_name.get(name)
        if family is None:
            self._by_name[name] = MetricFamily(name, kind, help_)
        for key in sorted(values, key=str):
            self.add(name, kind, help_, values[key], **{label: key}, **labels)

    def histogram(
        self, name: str, help_: str, bounds: tuple[float, ...], counts: tuple[int, ...], total: float
    ) -> None:
        cumulative, running = [], 0
        for bound, count in zip((*bounds, float("inf")), counts, strict=True):
            running += count
            cumulative.append(("+Inf" if bound == float("inf") else repr(float(bound)), float(running)))
        family = self._by_name.setdefault(name, MetricFamily(name, "histogram", help_))
        family.samples.append(Sample(dict(self.labels), float(total), tuple(cumulative)))

    def families(self) -> list[MetricFamily]:
        return list(self._by_name.values())


_DROPPED = "kvevents_events_dropped_total"
_DROPPED_HELP = "KV-cache events lost, per source attention-DP rank and reason (each lost event counts once)."


def manager_families(stats: ManagerStats, labels: Mapping[str, str] | None = None) -> list[MetricFamily]:
    """The families of one manager snapshot."""
    out = _Families(labels or {})
    _add_manager(out, stats)
    return out.families()


def sink_families(stats: SinkStats, labels: Mapping[str, str] | None = None) -> list[MetricFamily]:
    """The families of one sink snapshot."""
    out = _Families(labels or {})
    _add_sink(out, stats)
    return out.families()


def gather_families(stats: GatherStats, labels: Mapping[str, str] | None = None) -> list[MetricFamily]:
    """The families of one attention-DP gather snapshot."""
    out = _Families(labels or {})
    _add_gather(out, stats)
    return out.families()


def _add_manager(out: _Families, s: ManagerStats) -> None:
    b = s.buffer
    out.add(
        "kvevents_events_enqueued_total",
        "counter",
        "Event ids the engine thread handed out.",
        s.events_enqueued_total,
    )
    out.add(
        "kvevents_iterations_flushed_total", "counter", "Non-empty flush() calls.", s.iterations_flushed_total
    )
    out.add("kvevents_pending_iterations", "gauge", "Flushed iterations the manager's worker has not processed yet.",
            s.pending_iterations)  # fmt: skip
    out.add_each("kvevents_events_flushed_total", "counter", "Events the worker built (or dropped), per type.",
                 "type", s.events_flushed_by_type)  # fmt: skip
    out.add(
        "kvevents_stored_blocks_total",
        "counter",
        "Blocks carried by flushed Stored events.",
        s.stored_blocks_total,
    )
    out.add("kvevents_removed_block_hashes_total", "counter", "Hashes carried by flushed Removed events.",
            s.removed_block_hashes_total)  # fmt: skip
    out.add("kvevents_buffer_capacity_events", "gauge", "Most events the manager's buffer holds.", b.capacity)
    out.add("kvevents_buffer_events", "gauge", "Events in the manager's buffer now.", b.buffered_events)
    out.add("kvevents_buffer_high_water_mark_events", "gauge", "Most events the buffer ever held at once.",
            b.buffer_high_water_mark)  # fmt: skip
    out.add("kvevents_buffer_events_added_total", "counter", "Events offered to the manager's buffer.",
            b.events_added_total)  # fmt: skip
    out.add_each(_DROPPED, "counter", _DROPPED_HELP, "rank", b.events_dropped_by_rank, reason="buffer_full")
    out.add_each("kvevents_buffer_events_dropped_by_window_total", "counter",
                 "Events the manager's buffer dropped, per window size (when known).",
                 "window_size", b.events_dropped_by_window_size)  # fmt: skip
    out.add("kvevents_snapshot_requested", "gauge", "1 while this rank's engine should publish a snapshot.",
            1 if s.snapshot_requested else 0)  # fmt: skip
    out.add("kvevents_snapshot_requests_total", "counter", "Losses of this rank's events that asked for a snapshot.",
            s.snapshot_requests_total)  # fmt: skip
    out.add("kvevents_snapshots_published_total", "counter", "Snapshots the engine published (enqueue_snapshot).",
            s.snapshots_published_total)  # fmt: skip


def _add_gather(out: _Families, s: GatherStats) -> None:
    p = "kvevents_gather_"
    rank = {"attention_dp_rank": s.attention_dp_rank}
    out.add(p + "running", "gauge", "1 while the attention-DP gather runs on this rank.",
            1 if s.state == "running" else 0, **rank)  # fmt: skip
    if s.attention_dp_rank != 0:
        out.add(p + "messages_sent_total", "counter", "Event messages this rank sent to rank 0.",
                s.messages_sent_total, **rank)  # fmt: skip
        out.add(
            p + "events_sent_total",
            "counter",
            "Events this rank sent to rank 0.",
            s.events_sent_total,
            **rank,
        )
        out.add(
            p + "bytes_sent_total", "counter", "Bytes this rank sent to rank 0.", s.bytes_sent_total, **rank
        )
        out.add(
            p + "in_flight_messages",
            "gauge",
            "Messages sent and not yet completed.",
            s.in_flight_messages,
            **rank,
        )
        out.add(p + "sends_deferred_total", "counter", "Sends put off because max_in_flight messages were pending.",
                s.sends_deferred_total, **rank)  # fmt: skip
        out.add(p + "resyncs_received_total", "counter", "RESYNC messages from rank 0 (it lost this rank's events).",
                s.resyncs_received_total, **rank)  # fmt: skip
        return
    out.add(
        p + "messages_received_total", "counter", "Event messages rank 0 received.", s.messages_received_total
    )
    out.add(p + "events_received_total", "counter", "Events rank 0 received from the other ranks.",
            s.events_received_total)  # fmt: skip
    out.add(p + "bytes_received_total", "counter", "Bytes rank 0 received.", s.bytes_received_total)
    out.add(p + "messages_rejected_total", "counter", "Messages rank 0 rejected (counted as dropped events).",
            s.messages_rejected_total)  # fmt: skip
    out.add(
        p + "sequence_errors_total",
        "counter",
        "Messages that skipped a sequence number.",
        s.sequence_errors_total,
    )
    out.add(
        p + "ranks_dead", "gauge", "Ranks declared dead (silent past heartbeat_timeout_s).", len(s.ranks_dead)
    )
    out.add(p + "ranks_left", "gauge", "Ranks that left the gather.", len(s.ranks_left))
    out.add(p + "dead_rank_detections_total", "counter", "Times a rank was declared dead.",
            s.dead_rank_detections_total)  # fmt: skip
    out.add(p + "resyncs_sent_total", "counter", "RESYNC messages sent (losses of another rank's events).",
            s.resyncs_sent_total)  # fmt: skip


def _add_sink(out: _Families, s: SinkStats) -> None:
    for reason, counts in s.events_lost.items():
        out.add_each(_DROPPED, "counter", _DROPPED_HELP, "rank", counts, reason=reason)
    p = "kvevents_sink_"
    out.add(
        p + "events_drained_total",
        "counter",
        "Events the sink took from the manager.",
        s.events_drained_total,
    )
    out.add(p + "messages_produced_total", "counter", "Messages handed to librdkafka (the next sequence number).",
            s.messages_produced_total)  # fmt: skip
    out.add(
        p + "messages_delivered_total", "counter", "Messages Kafka acknowledged.", s.messages_delivered_total
    )
    out.add_each(p + "messages_failed_total", "counter", "Messages librdkafka failed or refused, per error.",
                 "error", s.messages_failed_by_error)  # fmt: skip
    out.add_each(p + "events_delivered_total", "counter", "Events Kafka acknowledged, per source rank.",
                 "rank", s.events_delivered_by_rank)  # fmt: skip
    out.add(
        p + "bytes_delivered_total", "counter", "Message bytes Kafka acknowledged.", s.bytes_delivered_total
    )
    out.add(
        p + "in_flight_messages",
        "gauge",
        "Messages in librdkafka, not yet acknowledged.",
        s.in_flight_messages,
    )
    out.add(p + "in_flight_events", "gauge", "Events in those messages.", s.in_flight_events)
    out.add(p + "queue_messages", "gauge", "Messages waiting in the sink's queue.", s.queued_messages)
    out.add(p + "queue_events", "gauge", "Events waiting in the sink's queue.", s.queued_events)
    out.add(p + "queue_bytes", "gauge", "Encoded bytes waiting in the sink's queue.", s.queued_bytes)
    out.add(
        p + "queue_capacity_events", "gauge", "Bound of the sink's queue, in events.", s.max_queued_events
    )
    out.add(p + "queue_capacity_bytes", "gauge", "Bound of the sink's queue, in bytes.", s.max_queued_bytes)
    out.add(p + "queue_high_water_mark_events", "gauge", "Most events the sink's queue ever held.",
            s.queue_high_water_events)  # fmt: skip
    out.add(
        p + "events_split_total", "counter", "Stored events cut into several messages.", s.events_split_total
    )
    out.add(
        p + "fragments_total",
        "counter",
        "Messages holding a fragment of a split Stored event.",
        s.fragments_total,
    )
    out.add_each(p + "drops_reported_total", "counter",
                 "Lost events reported in-band (EventBatch.dropped) by a delivered batch, per source rank.",
                 "rank", s.drops_reported_by_rank)  # fmt: skip
    out.add_each(p + "drops_unreported", "gauge",
                 "Lost events no delivered batch has reported yet, per source rank.", "rank", s.drops_pending_by_rank)  # fmt: skip
    out.add_each(p + "errors_total", "counter", "Errors librdkafka reported (error_cb), per error code.",
                 "code", s.errors_by_code)  # fmt: skip
    out.add(p + "fatal_error", "gauge", "1 when the producer hit a fatal error.", 1 if s.fatal_error else 0)
    out.add(p + "message_limit_bytes", "gauge", "Largest message the sink produces.", s.message_limit_bytes)
    latency = s.delivery_latency
    out.histogram(p + "delivery_latency_seconds", "From produce() to Kafka's acknowledgement.",
                  latency.bucket_bounds_s, latency.bucket_counts, latency.sum_s)  # fmt: skip
    if "msg_cnt" in s.librdkafka:
        out.add(p + "librdkafka_queue_messages", "gauge", "Messages in librdkafka's queues (statistics).",
                s.librdkafka["msg_cnt"])  # fmt: skip
    if "msg_size" in s.librdkafka:
        out.add(p + "librdkafka_queue_bytes", "gauge", "Bytes in librdkafka's queues (statistics).",
                s.librdkafka["msg_size"])  # fmt: skip


class ProducerMetrics:
    """The metrics of managers and sinks, read fresh on every call.

    ``labels`` are added to every sample of this source; by default
    ``{"instance_id": sink.instance_id}`` when a sink is given, else none. :meth:`add` adds more
    sources (say, every sink of a process) into the same families: Prometheus allows one
    collector per metric name in a registry, so register one ``ProducerMetrics`` per process.
    """

    def __init__(
        self,
        manager: KVCacheEventManager | None = None,
        sink: KafkaEventSink | None = None,
        *,
        labels: Mapping[str, str] | None = None,
    ) -> None:
        self._sources: list[tuple[Any, Any, dict[str, str]]] = []
        self.add(manager, sink, labels=labels)

    def add(
        self,
        manager: KVCacheEventManager | None = None,
        sink: KafkaEventSink | None = None,
        *,
        labels: Mapping[str, str] | None = None,
    ) -> None:
        """Report ``manager`` and/or ``sink`` too, with ``labels`` (see the class doc)."""
        if manager is None and sink is None:
            raise ValueError("ProducerMetrics needs a manager, a sink, or both")
        if labels is None:
            labels = {"instance_id": sink.instance_id} if sink is not None else {}
        self._sources.append((manager, sink, dict(labels)))

    @property
    def labels(self) -> dict[str, str]:
        """The first source's labels."""
        return dict(self._sources[0][2])

    def families(self) -> list[MetricFamily]:
        """Every family, from fresh snapshots of every source."""
        out = _Families({})
        for manager, sink, labels in self._sources:
            out.labels = labels
            if manager is not None:
                _add_manager(out, manager.stats())
                gather = manager.gather
                if gather is not None:
                    _add_gather(out, gather.stats())
            if sink is not None:
                _add_sink(out, sink.stats())
        return out.families()

    def as_dict(self) -> dict[str, float]:
        """Flat ``{'name{label="v",...}': value}`` of every counter and gauge (histograms give
        ``_count`` and ``_sum``)."""
        flat: dict[str, float] = {}
        for family in self.families():
            for sample in family.samples:
                if family.kind == "histogram":
                    flat[_key(family.name + "_count", sample.labels)] = sample.buckets[-1][1]
                    flat[_key(family.name + "_sum", sample.labels)] = sample.value
                else:
                    flat[_key(family.name, sample.labels)] = sample.value
        return flat

    def value(self, name: str, **labels: str) -> float:
        """The sum of ``name``'s samples whose labels include ``labels`` (0 when none)."""
        total = 0.0
        for family in self.families():
            if family.name == name:
                for sample in family.samples:
                    if all(sample.labels.get(k) == v for k, v in labels.items()):
                        total += sample.value
        return total

    def collector(self) -> PrometheusCollector:
        """A ``prometheus_client`` collector of these metrics (needs ``prometheus_client``)."""
        return PrometheusCollector(self)

    def register(self, registry: Any = None) -> PrometheusCollector:
        """Register :meth:`collector` into ``registry`` (prometheus_client's default if None)."""
        collector = self.collector()
        if registry is None:
            registry = _prometheus().REGISTRY
        registry.register(collector)
        return collector


def _key(name: str, labels: Mapping[str, str]) -> str:
    if not labels:
        return name
    return name + "{" + ",".join(f'{k}="{labels[k]}"' for k in sorted(labels)) + "}"


def _prometheus() -> Any:
    try:
        import prometheus_client
        import prometheus_client.core
    except ImportError as exc:
        raise ImportError(
            "Prometheus metrics need prometheus_client: pip install 'kvevents[metrics]'"
        ) from exc
    return prometheus_client


class PrometheusCollector:
    """A ``prometheus_client`` custom collector: each scrape reads fresh stats snapshots."""

    def __init__(self, metrics: ProducerMetrics) -> None:
        self._core = _prometheus().core
        self._metrics = metrics

    def collect(self) -> Iterator[Any]:
        core = self._core
        for family in self._metrics.families():
            names = sorted({k for s in family.samples for k in s.labels})
            if family.kind == "counter":
                metric = core.CounterMetricFamily(
                    family.name.removesuffix("_total"), family.help, labels=names
                )
            elif family.kind == "gauge":
                metric = core.GaugeMetricFamily(family.name, family.help, labels=names)
            else:
                metric = core.HistogramMetricFamily(family.name, family.help, labels=names)
            for sample in family.samples:
                values = [sample.labels.get(name, "") for name in names]
                if family.kind == "histogram":
                    metric.add_metric(values, list(sample.buckets), sample.value)
                else:
                    metric.add_metric(values, sample.value)
            yield metric

    def describe(self) -> Iterator[Any]:
        """What ``collect`` yields (the registry asks once, to check for name clashes)."""
        return self.collect()
