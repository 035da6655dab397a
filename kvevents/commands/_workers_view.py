"""The workers of an index as rows (for JSON) and as a text table (``index``, ``route``)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvevents.consumer import CacheIndex, ReaderMetrics, WorkerKey

__all__ = ["index_summary", "render_workers", "worker_rows"]

MAX_REASON = 60


def worker_rows(index: CacheIndex, keys: Iterable[WorkerKey] | None = None) -> list[dict[str, Any]]:
    """One JSON-ready dict per worker (``keys``, default every one; a key the index does not
    know is left out): blocks per window and cache level, degraded flag and reasons, last event
    id, producer session."""
    rows = []
    for key in index.workers() if keys is None else keys:
        try:
            stats = index.worker_stats(key)
        except KeyError:
            continue
        rows.append(
            {
                "instance_id": key.instance_id,
                "attention_dp_rank": key.attention_dp_rank,
                "blocks": stats.blocks,
                "blocks_by_level": {str(level): n for level, n in sorted(stats.blocks_by_level.items())},
                "windows": {
                    str(w): {
                        "blocks": ws.blocks,
                        "blocks_by_level": {str(level): n for level, n in sorted(ws.blocks_by_level.items())},
                        "capacity": None if ws.capacity is None else list(ws.capacity),
                    }
                    for w, ws in sorted(stats.windows.items())
                },
                "degraded": stats.degraded,
                "degraded_reasons": list(stats.degraded_reasons),
                "last_event_id": stats.last_event_id,
                "producer_id": stats.producer_id,
                "last_batch_sequence": stats.last_batch_sequence,
            }
        )
    return rows


def index_summary(index: CacheIndex, metrics: ReaderMetrics | None = None) -> dict[str, Any]:
    """Index-wide figures, and the reader's when given (lag, throughput, malformed)."""
    stats = index.stats()
    summary: dict[str, Any] = {
        "workers": stats.workers,
        "degraded_workers": stats.degraded_workers,
        "held_blocks": stats.held_blocks,
        "distinct_blocks": stats.distinct_blocks,
        "memory_bytes": stats.memory_bytes,
        "events_applied": stats.counters.get("events_applied", 0),
        "counters": dict(stats.counters),
    }
    if metrics is not None:
        summary.update(
            messages=metrics.messages_total,
            events_read=metrics.events_total,
            bytes=metrics.bytes_total,
            malformed=metrics.malformed_total,
            kafka_errors=metrics.errors_total,
            lag_messages=metrics.lag_total,
            caught_up=metrics.caught_up,
            events_per_s_recent=round(metrics.recent.events_per_s, 1),
        )
    return summary


def _levels_of(rows: list[dict[str, Any]]) -> list[str]:
    levels = {level for row in rows for w in row["windows"].values() for level in w["blocks_by_level"]}
    return sorted(levels | {"0"}, key=int)


def render_workers(rows: list[dict[str, Any]], summary: dict[str, Any]) -> list[str]:
    """A text table: one line per (worker, window size), then a summary line."""
    levels = _levels_of(rows)
    head = f"{'instance':<20} {'rank':>4} {'window':>7} {'blocks':>8} " + " ".join(
        f"{'L' + lv:>7}" for lv in levels
    )
    head += f" {'capacity':>12} {'last_id':>9}  state"
    lines = [head]
    for row in rows:
        windows = row["windows"] or {"-": {"blocks": 0, "blocks_by_level": {}, "capacity": None}}
        state = "ok"
        if row["degraded"]:
            reason = row["degraded_reasons"][-1] if row["degraded_reasons"] else ""
            state = "DEGRADED" + (f" ({reason[:MAX_REASON]})" if reason else "")
        for window, ws in windows.items():
            capacity = "-" if ws["capacity"] is None else ",".join(map(str, ws["capacity"]))
            last = "-" if row["last_event_id"] is None else str(row["last_event_id"])
            lines.append(
                f"{row['instance_id'][:20]:<20} {row['attention_dp_rank']:>4} {window:>7} {ws['blocks']:>8} "
                + " ".join(f"{ws['blocks_by_level'].get(lv, 0):>7}" for lv in levels)
                + f" {capacity:>12} {last:>9}  {state}"
            )
    foot = (
        f"{summary['workers']} worker(s), {summary['degraded_workers']} degraded; "
        f"{summary['held_blocks']:,} held blocks ({summary['distinct_blocks']:,} distinct), "
        f"{summary['memory_bytes'] / 1e6:,.1f} MB; {summary['events_applied']:,} events applied"
    )
    if "lag_messages" in summary:
        foot += (
            f"; lag {summary['lag_messages']:,} msgs; {summary['events_per_s_recent']:,.0f} ev/s recent; "
            f"{summary['malformed']} malformed"
        )
    lines.append(foot)
    return lines
