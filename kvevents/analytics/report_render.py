"""The cache report as text tables, one PNG of four plots, and one self-contained HTML page
(the tables and the PNG embedded, no external files or scripts)."""

from __future__ import annotations

import base64
import html
import io
from typing import Any

from kvevents.commands._format import format_time_us

from .report import CacheReport

__all__ = ["render_html", "render_png", "report_tables"]

Table = tuple[str, list[str], list[list[str]]]  # title, header, rows


def report_tables(report: dict[str, Any]) -> list[Table]:
    """The report's sections as (title, header, rows) tables."""
    r = report["range"]
    events = report["events"]
    tables: list[Table] = [
        (
            f"Events ({r['batches']:,} batches, {r['seconds']:.1f} s from {format_time_us(r['first_us'] or 0)} "
            f"to {format_time_us(r['last_us'] or 0)}, {len(report['workers'])} workers)",
            ["event type", "events", "per second"],
            [[k, f"{n:,}", f"{report['rates_per_s'][k]:,.1f}"] for k, n in events.items()],
        )
    ]
    reuse = report["prefix_reuse"]
    tables.append(
        (
            "Prefix reuse across workers",
            ["measure", "value"],
            [
                ["stored blocks", f"{reuse['stored_blocks']:,}"],
                [
                    "already stored by another worker",
                    f"{reuse['already_stored_by_another_worker']:,} ({reuse['share']:.1%})",
                ],
                ["stored again by the same worker", f"{reuse['stored_again_by_the_same_worker']:,}"],
                ["Stored events continuing a prefix", f"{reuse['stored_events_with_parent']:,}"],
                ["... whose parent another worker stored", f"{reuse['parent_stored_by_another_worker']:,}"],
            ],
        )
    )
    life = report["block_lifetimes"]
    tables.append(
        (
            "Block lifetimes (Stored to Removed on the same worker)",
            [
                "blocks",
                "p50 s",
                "p90 s",
                "p99 s",
                "max s",
                "still held",
                "ended by Created",
                "no Stored in range",
            ],
            [
                [
                    f"{life['count']:,}",
                    f"{life['p50_s']:.3f}",
                    f"{life['p90_s']:.3f}",
                    f"{life['p99_s']:.3f}",
                    f"{life['max_s']:.3f}",
                    f"{life['still_held']:,}",
                    f"{life['ended_by_created']:,}",
                    f"{life['removed_without_store_in_range']:,}",
                ]
            ],
        )
    )
    tiers = report["tiers"]
    tables.append(
        (
            f"Eviction churn per tier (offloads primary->secondary {tiers['offloads_primary_to_secondary']:,}, "
            f"onboards secondary->primary {tiers['onboards_secondary_to_primary']:,})",
            ["tier", "evicted blocks", "per second"],
            [[t, f"{n:,}", f"{tiers['evictions_per_s'][t]:,.1f}"] for t, n in tiers["evictions"].items()],
        )
    )
    routing = report["routing"]
    names = {
        "cache_aware": "cache-aware router",
        "round_robin": "round-robin",
        "observed": "what happened (observed)",
    }
    tables.append(
        (
            f"Prefix hit rate ({routing['requests_scored']:,} Stored events scored as requests, "
            f"{routing['chain_blocks']:,} chain blocks"
            + (
                f"; {routing['parents_forgotten']:,} parents stored long ago forgotten, chains cut there)"
                if routing["parents_forgotten"]
                else ")"
            ),
            ["policy", "hit rate"],
            [[names[p], f"{v:.1%}"] for p, v in routing["hit_rate"].items()],
        )
    )
    loss = report["loss"]
    tables.append(
        (
            f"Loss and degraded time (dropped {loss['dropped_events']:,} events, {loss['missing_batches']:,} batches "
            f"missing, {loss['event_ids_skipped']:,} event ids skipped, {loss['malformed_messages']:,} malformed)",
            [
                "worker",
                "dropped events",
                "degraded spells",
                "degraded s",
                "share of range",
                "degraded at end",
            ],
            [
                [
                    w,
                    f"{v['dropped_events']:,}",
                    f"{v['degraded_spells']:,}",
                    f"{v['degraded_s']:.2f}",
                    f"{v['degraded_share']:.1%}",
                    "yes" if v["degraded_now"] else "no",
                ]
                for w, v in loss["by_worker"].items()
            ],
        )
    )
    return tables


def render_text(report: dict[str, Any]) -> list[str]:
    """The tables as aligned text lines."""
    lines: list[str] = []
    for title, header, rows in report_tables(report):
        widths = [max(len(cell) for cell in column) for column in zip(header, *rows, strict=True)]
        lines += ["", title]
        lines.append(
            "  ".join(
                h.ljust(w) if i == 0 else h.rjust(w)
                for i, (h, w) in enumerate(zip(header, widths, strict=True))
            )
        )
        for row in rows:
            lines.append(
                "  ".join(
                    c.ljust(w) if i == 0 else c.rjust(w)
                    for i, (c, w) in enumerate(zip(row, widths, strict=True))
                )
            )
    return lines[1:]


def render_png(cache: CacheReport, report: dict[str, Any], title: str) -> bytes:
    """Four plots: evictions per tier over time, block lifetimes, hit rate per policy, and
    degraded time per worker."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, ((churn, lifetimes), (routing, loss)) = plt.subplots(2, 2, figsize=(13, 8.5), dpi=100)
    figure.suptitle(title, fontsize=13)

    span = report["range"]["seconds"] or 1.0
    bucket = _nice_bucket(span / 60)
    times, series = cache.eviction_series(bucket)
    for tier, values in sorted(series.items()):
        churn.step(times, values, where="post", label=tier, linewidth=1.4)
    churn.set_title("Eviction churn per tier")
    churn.set_xlabel(f"seconds since the first eviction (buckets of {bucket:g} s)")
    churn.set_ylabel("evicted blocks per second")
    if series:
        churn.legend(loc="upper right")
    churn.grid(True, alpha=0.3)

    values = [v for v in cache.stats.lifetimes_s if v > 0]
    if values:
        low, high = min(values), max(values)
        if high / low > 20:
            edges = [low * (high / low) ** (i / 40) for i in range(41)]
            lifetimes.set_xscale("log")
        else:
            edges = [low + (high - low) * i / 40 for i in range(41)]
        lifetimes.hist(values, bins=edges, color="#4c72b0")
    life = report["block_lifetimes"]
    lifetimes.set_title(f"Block lifetimes (p50 {life['p50_s']:.2f} s, p99 {life['p99_s']:.2f} s)")
    lifetimes.set_xlabel("seconds from Stored to Removed")
    lifetimes.set_ylabel("blocks")
    lifetimes.grid(True, alpha=0.3)

    rates = report["routing"]["hit_rate"]
    labels = ["cache-aware", "round-robin", "observed"]
    bars = routing.bar(labels, [100 * rates[k] for k in ("cache_aware", "round_robin", "observed")],
                       color=["#55a868", "#c44e52", "#8172b2"])  # fmt: skip
    routing.bar_label(bars, fmt="%.1f%%", padding=2)
    routing.set_ylim(0, 105)
    routing.set_title(f"Prefix hit rate ({report['routing']['requests_scored']:,} Stored events as requests)")
    routing.set_ylabel("% of chain blocks already cached")
    routing.grid(True, axis="y", alpha=0.3)

    workers = report["loss"]["by_worker"]
    names = list(workers)
    degraded = [100 * workers[w]["degraded_share"] for w in names]
    bars = loss.barh(names, degraded, color="#dd8452")
    loss.bar_label(
        bars,
        labels=[
            f"{d:.1f}%, {workers[w]['dropped_events']:,} dropped"
            for w, d in zip(names, degraded, strict=True)
        ],
        padding=4,
    )
    loss.set_xlim(0, 115)
    loss.invert_yaxis()
    loss.set_title("Time degraded (index view incomplete) per worker")
    loss.set_xlabel("% of the range")
    loss.grid(True, axis="x", alpha=0.3)

    figure.tight_layout()
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png")
    plt.close(figure)
    return buffer.getvalue()


def _nice_bucket(seconds: float) -> float:
    """The smallest of 0.1, 0.2, 0.5, 1, 2, 5, 10, ... seconds not below ``seconds``."""
    for exponent in range(-1, 7):
        for step in (1, 2, 5):
            if step * 10**exponent >= seconds:
                return float(step * 10**exponent)
    return 1e7


def render_html(report: dict[str, Any], png: bytes | None, title: str) -> str:
    """One self-contained page: the tables, then the plots (inline PNG)."""
    parts = [
        "<!doctype html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>{html.escape(title)}</title>",
        "<style>body{font-family:system-ui,sans-serif;margin:2em;max-width:1300px;color:#222}"
        "table{border-collapse:collapse;margin:0.5em 0 1.5em}"
        "th,td{border:1px solid #ccc;padding:4px 10px}td:not(:first-child){text-align:right}"
        "th{background:#f3f3f3}h2{font-size:1.05em;margin-bottom:0.2em}img{max-width:100%}</style>",
        f"</head><body><h1>{html.escape(title)}</h1>",
    ]
    for table_title, header, rows in report_tables(report):
        parts.append(f"<h2>{html.escape(table_title)}</h2><table><tr>")
        parts.append("".join(f"<th>{html.escape(h)}</th>" for h in header) + "</tr>")
        for row in rows:
            parts.append("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>")
        parts.append("</table>")
    if png is not None:
        encoded = base64.b64encode(png).decode("ascii")
        parts.append(f'<h2>Plots</h2><img alt="cache report plots" src="data:image/png;base64,{encoded}">')
    parts.append("</body></html>")
    return "\n".join(parts)
