"""``GET /metrics`` of ``route --serve``: Prometheus text format (0.0.4), written directly (one
process's figures: with ``--workers N`` each process answers for itself, label ``process``)."""

from __future__ import annotations

import bisect
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvevents.consumer import CacheIndex, FollowerHealth, ReaderMetrics

    from kvevents.commands._route_gc import GcPauses

__all__ = ["LATENCY_BUCKETS_S", "RequestMetrics", "match_form", "render"]

LATENCY_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)


class RequestMetrics:
    """Request counts by (route, status) and a latency histogram by route and form (event loop
    only). ``form`` tells the answers of one route apart whose costs differ by an order of
    magnitude: ``single`` (one prompt), ``batch`` (``prompts``), ``error`` (a match request
    answered with an error); the empty form (other routes) is no label at all."""

    def __init__(self) -> None:
        self.counts: dict[tuple[str, int], int] = {}
        self.buckets: dict[tuple[str, str], list[int]] = {}
        self.sums: dict[tuple[str, str], float] = {}

    def observe(self, route: str, status: int, seconds: float, form: str = "") -> None:
        key = (route, status)
        self.counts[key] = self.counts.get(key, 0) + 1
        series = (route, form)
        buckets = self.buckets.get(series)
        if buckets is None:
            buckets = self.buckets[series] = [0] * (len(LATENCY_BUCKETS_S) + 1)
            self.sums[series] = 0.0
        buckets[bisect.bisect_left(LATENCY_BUCKETS_S, seconds)] += 1
        self.sums[series] += seconds


def match_form(status: int, answer: bytes) -> str:
    """The ``form`` of a match request's answer: every batch answer starts ``{"results":``."""
    if status != 200:
        return "error"
    return "batch" if answer.startswith(b'{"results":') else "single"


def _line(out: list[str], name: str, value: float, labels: str = "") -> None:
    out.append(f"{name}{{{labels}}} {value}" if labels else f"{name} {value}")


def _head(out: list[str], name: str, kind: str, text: str) -> None:
    out.append(f"# HELP {name} {text}")
    out.append(f"# TYPE {name} {kind}")


def render(
    requests: RequestMetrics,
    index: CacheIndex,
    *,
    process: int,
    health: FollowerHealth | None,
    reader: ReaderMetrics | None,
    states: dict[str, int],
    gc_pauses: GcPauses | None = None,
) -> str:
    """The whole exposition; ``states``: workers per liveness state (live, stale, closed);
    ``gc_pauses``: this process's garbage collections, if they are timed."""
    p = f'process="{process}"'
    out: list[str] = []
    _head(out, "kvevents_router_requests_total", "counter", "HTTP requests answered, by route and status")
    for (route, status), n in sorted(requests.counts.items()):
        _line(out, "kvevents_router_requests_total", n, f'{p},route="{route}",status="{status}"')
    _head(
        out,
        "kvevents_router_request_duration_seconds",
        "histogram",
        "time to answer, by route and form (match routes: single, batch, error)",
    )
    for (route, form), buckets in sorted(requests.buckets.items()):
        labels = f'{p},route="{route}",form="{form}"' if form else f'{p},route="{route}"'
        total = 0
        for bound, n in zip((*LATENCY_BUCKETS_S, float("inf")), buckets, strict=True):
            total += n
            le = "+Inf" if bound == float("inf") else repr(bound)
            _line(
                out,
                "kvevents_router_request_duration_seconds_bucket",
                total,
                f'{labels},le="{le}"',
            )
        _line(
            out,
            "kvevents_router_request_duration_seconds_sum",
            round(requests.sums[route, form], 6),
            labels,
        )
        _line(out, "kvevents_router_request_duration_seconds_count", total, labels)
    stats = index.stats()
    gauges: list[tuple[str, str, float]] = [
        ("kvevents_index_workers", "workers the index knows", stats.workers),
        ("kvevents_index_degraded_workers", "workers whose view may be incomplete (lost events)", stats.degraded_workers),
        ("kvevents_index_held_blocks", "worker-block pairs held", stats.held_blocks),
        ("kvevents_index_distinct_blocks", "distinct blocks", stats.distinct_blocks),
        ("kvevents_index_memory_bytes", "estimated memory of the index", stats.memory_bytes),
    ]  # fmt: skip
    for name, text, value in gauges:
        _head(out, name, "gauge", text)
        _line(out, name, value, p)
    _head(
        out,
        "kvevents_index_liveness_workers",
        "gauge",
        "workers by liveness state (stale, closed: not routed to)",
    )
    for state in ("live", "stale", "closed"):
        _line(out, "kvevents_index_liveness_workers", states.get(state, 0), f'{p},state="{state}"')
    if health is not None:
        _head(out, "kvevents_router_ready", "gauge", "1 when /readyz answers 200")
        _line(out, "kvevents_router_ready", int(health.ready), p)
        _head(out, "kvevents_follower_alive", "gauge", "1 while the follower thread runs")
        _line(out, "kvevents_follower_alive", int(health.follower_alive), p)
        _head(out, "kvevents_broker_ok", "gauge", "1 when the broker answered the last probe")
        _line(out, "kvevents_broker_ok", int(health.broker_ok), p)
        if health.lag_messages is not None:
            _head(out, "kvevents_consumer_lag_messages", "gauge", "messages behind the high watermarks")
            _line(out, "kvevents_consumer_lag_messages", health.lag_messages, p)
    if reader is not None:
        counters: list[tuple[str, str, Any]] = [
            ("kvevents_consumer_messages_total", "batches (messages) applied", reader.messages_total),
            ("kvevents_consumer_events_total", "events read", reader.events_total),
            ("kvevents_consumer_bytes_total", "bytes read", reader.bytes_total),
            ("kvevents_consumer_malformed_total", "malformed messages set aside", reader.malformed_total),
            ("kvevents_consumer_kafka_errors_total", "Kafka client errors", reader.errors_total),
        ]
        for name, text, value in counters:
            _head(out, name, "counter", text)
            _line(out, name, value, p)
        _head(out, "kvevents_consumer_messages_per_second", "gauge", "batches applied per second, recent")
        _line(out, "kvevents_consumer_messages_per_second", round(reader.recent.messages_per_s, 3), p)
        _head(out, "kvevents_consumer_events_per_second", "gauge", "events applied per second, recent")
        _line(out, "kvevents_consumer_events_per_second", round(reader.recent.events_per_s, 3), p)
    if gc_pauses is not None:
        _gc(out, p, gc_pauses)
    return "\n".join(out) + "\n"


def _gc(out: list[str], p: str, pauses: GcPauses) -> None:
    import gc

    _head(out, "kvevents_router_gc_collections_total", "counter", "garbage collections, by generation")
    for g, n in enumerate(pauses.count):
        _line(out, "kvevents_router_gc_collections_total", n, f'{p},generation="{g}"')
    _head(
        out, "kvevents_router_gc_pause_seconds_total", "counter", "time in garbage collections, by generation"
    )
    for g, s in enumerate(pauses.seconds):
        _line(out, "kvevents_router_gc_pause_seconds_total", round(s, 6), f'{p},generation="{g}"')
    _head(out, "kvevents_router_gc_pause_max_seconds", "gauge", "longest garbage collection, by generation")
    for g, s in enumerate(pauses.max_seconds):
        _line(out, "kvevents_router_gc_pause_max_seconds", round(s, 6), f'{p},generation="{g}"')
    _head(out, "kvevents_router_gc_frozen_objects", "gauge", "objects frozen once the index was loaded")
    _line(out, "kvevents_router_gc_frozen_objects", gc.get_freeze_count(), p)
