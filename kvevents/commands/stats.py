"""``kvevents stats``: analytics over a time range of the events topic, as a text table, JSON,
and a PNG chart of the event rates."""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvevents.commands._common import (
    EXIT_INTERRUPTED,
    CommandError,
    Progress,
    add_kafka_flags,
    add_output_flags,
    check_kafka,
    command,
    kafka_config,
    reader_codec,
    resolve_bootstrap,
    stop_on_interrupt,
)
from kvevents.commands._format import printable

if TYPE_CHECKING:
    from kvevents.commands._stats import StreamStats

DESCRIPTION = """\
Analytics over a stretch of the events topic (up to its end as it is at start):

  rates        events per second by type (created, stored, removed, updated)
  level moves  Updated events moving blocks primary->secondary (offload) and back (onboard)
  lifetimes    seconds from a block's Stored to its Removed event (p50/p90/p99/max; past 1M
               lifetimes the percentiles come from a uniform sample of 1M)
  prefix reuse Stored blocks another worker had already stored (by engine hash), and
               Stored events continuing a prefix another worker stored (over the 2-4M
               block hashes stored last; older ones are forgotten and counted)
  drops, gaps  events dropped in-band per worker, missing batches (sequence jumps),
               skipped event ids per worker, replays, malformed messages

--since/--until take an ISO time (2026-12-02T15:30:00Z; local time without a zone), a time
relative to now (30s, 10m, 2h, 1d), or a bare number: an offset in every partition. A batch's
time is its creation time (EventBatch.created_at_us), else its Kafka timestamp.
--plot FILE.png draws the rates over time (needs matplotlib: pip install 'kvevents[cli]').
"""

EPILOG = """\
examples:
  kvevents stats                                  # the whole topic
  kvevents stats --since 10m --plot rates.png     # the last ten minutes, and a chart
  kvevents stats --since 2026-12-02T15:00:00Z --until 2026-12-02T15:05:00Z --json
  kvevents stats --since 1000 --until 5000        # offsets 1000..4999 of every partition
"""

_RELATIVE = re.compile(r"^(\d+(?:\.\d+)?)(ms|s|m|h|d)$")
_UNIT_S = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


@dataclass(frozen=True)
class Bound:
    """A range bound: a time (microseconds since the epoch) or an offset of every partition."""

    time_us: int | None = None
    offset: int | None = None


def parse_bound(text: str, now: float | None = None) -> Bound:
    """``10m`` / ``2h`` (before now), an ISO time, or a bare integer offset."""
    value = text.strip()
    if value.isdigit():
        return Bound(offset=int(value))
    match = _RELATIVE.match(value)
    if match:
        seconds = float(match.group(1)) * _UNIT_S[match.group(2)]
        return Bound(time_us=int(((time.time() if now is None else now) - seconds) * 1e6))
    try:
        moment = dt.datetime.fromisoformat(value.replace("Z", "+00:00") if value.endswith("Z") else value)
    except ValueError:
        raise ValueError(
            f"{text!r} is not a time or an offset: use an ISO time (2026-12-02T15:30:00Z), a relative "
            "time (30s, 10m, 2h, 1d) or an offset (a bare number)"
        ) from None
    if moment.tzinfo is None:
        moment = moment.astimezone()  # local time
    return Bound(time_us=int(moment.timestamp() * 1e6))


def _bound(text: str | None) -> Bound | None:
    if text is None:
        return None
    try:
        return parse_bound(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``stats``."""
    parser = subparsers.add_parser(
        "stats",
        help="analytics over a time range: event rates, level moves, lifetimes, prefix reuse, drops; --plot",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_kafka_flags(parser)
    rng = parser.add_argument_group("range")
    rng.add_argument(
        "--since", type=_bound, default=None, metavar="WHEN", help="start (default: the beginning)"
    )
    rng.add_argument(
        "--until", type=_bound, default=None, metavar="WHEN", help="end, excluded (default: the end at start)"
    )
    rng.add_argument(
        "--bucket",
        type=float,
        default=None,
        metavar="SECONDS",
        help="time bucket of the rates over time (default: about span/60)",
    )
    parser.add_argument(
        "--plot", type=Path, default=None, metavar="FILE.png", help="draw the event rates over time"
    )
    add_output_flags(parser, json_help="print every figure as one JSON object")
    parser.set_defaults(func=run)


def _start(args: argparse.Namespace, bootstrap: str) -> str | dict[int, int]:
    from kvevents.commands._stream import start_offsets_for_time

    since: Bound | None = args.since
    if since is None:
        return "beginning"
    if since.offset is not None:
        return _every_partition(args, bootstrap, since.offset)
    assert since.time_us is not None
    try:
        return start_offsets_for_time(bootstrap, args.topic, since.time_us // 1000, kafka_config(args))
    except (ValueError, RuntimeError) as exc:
        raise CommandError(str(exc)) from exc


def _every_partition(args: argparse.Namespace, bootstrap: str, offset: int) -> dict[int, int]:
    """``offset`` in every partition, capped at each partition's end."""
    from confluent_kafka import Consumer, TopicPartition

    consumer = Consumer({**kafka_config(args), "bootstrap.servers": bootstrap, "group.id": "kvevents-stats"})
    try:
        info = consumer.list_topics(args.topic, timeout=30).topics.get(args.topic)
        if info is None or info.error is not None or not info.partitions:
            raise CommandError(f"topic {args.topic!r} not found")
        return {
            p: min(offset, consumer.get_watermark_offsets(TopicPartition(args.topic, p), timeout=30)[1])
            for p in sorted(info.partitions)
        }
    finally:
        consumer.close()


def _in_range(until: Bound | None, offset: int, time_us: int) -> bool:
    if until is None:
        return True
    if until.offset is not None:
        return offset < until.offset
    return time_us <= 0 or until.time_us is None or time_us < until.time_us


def _bucket(args: argparse.Namespace) -> float:
    if args.bucket is not None:
        if args.bucket <= 0:
            raise CommandError("--bucket must be > 0", code=2)
        return float(args.bucket)
    since, until = args.since, args.until
    if since is not None and until is not None and since.time_us is not None and until.time_us is not None:
        return auto_bucket((until.time_us - since.time_us) / 1e6)
    return 0.0  # decided after reading: span / 60


@command("stats")
def run(args: argparse.Namespace) -> int:
    """Run ``kvevents stats``."""
    from kvevents.consumer import EventReader, ReaderError

    from kvevents.commands._stats import StreamStats
    from kvevents.commands._stream import Malformed, decoded_messages

    if args.plot is not None:
        _require_matplotlib()
    bucket = _bucket(args)
    bootstrap = resolve_bootstrap(args)
    check_kafka(args, bootstrap, topic=args.topic)
    start = _start(args, bootstrap)
    try:
        reader = EventReader(
            bootstrap, args.topic, start=start, config=kafka_config(args), codec=reader_codec(args)
        )
    except (ReaderError, ValueError) as exc:
        raise CommandError(str(exc)) from exc
    received: list[tuple[Any, int, int]] = []  # (batch, time_us, size), for the buckets decided at the end
    stats = StreamStats(bucket_s=bucket or 1.0)
    show = Progress(enabled=not args.quiet)

    def malformed(bad: Malformed) -> None:
        stats.malformed += 1
        print(f"kvevents stats: {bad.describe(args.topic)}", file=sys.stderr)

    read = 0
    try:
        with stop_on_interrupt(reader.stop) as interrupted:
            for item in decoded_messages(reader, follow=False, on_malformed=malformed):
                read += 1
                time_us = item.time_us
                if not _in_range(args.until, item.offset, time_us):
                    continue
                if bucket:
                    stats.add(item.batch, time_us, item.size)
                else:
                    received.append((item.batch, time_us, item.size))
                if show.due():
                    show.update(
                        f"reading: {read:,} batches, at offset {item.offset} of partition {item.partition}"
                    )
    except ReaderError as exc:
        raise CommandError(str(exc)) from exc
    finally:
        reader.close()
    show.done()
    if not bucket:
        stats = _replay(received, stats.malformed)
    report = stats.to_json()
    report["topic"] = args.topic
    report["bucket_s"] = stats.bucket_s
    report["interrupted"] = bool(interrupted)
    if args.plot is not None:
        _plot(stats, args.plot, args.topic)
        report["plot"] = str(args.plot)
    if args.json:
        print(json.dumps(report))
    else:
        print("\n".join(render(report)))
    return EXIT_INTERRUPTED if interrupted else 0


def auto_bucket(span_s: float) -> float:
    """About 60 buckets over the span: a 1-2-5 step of at least 1 ms."""
    target = max(span_s / 60, 0.001)
    step: float = 10 ** math.floor(math.log10(target))
    for factor in (1, 2, 5, 10):
        if step * factor >= target:
            return round(step * factor, 6)
    return target


def _replay(received: list[tuple[Any, int, int]], malformed: int) -> StreamStats:
    """Count with a bucket of span/60 (at least 1 s), known once everything is read."""
    from kvevents.commands._stats import StreamStats

    times = [t for _, t, _ in received if t > 0]
    span = (max(times) - min(times)) / 1e6 if times else 0.0
    stats = StreamStats(bucket_s=auto_bucket(span))
    stats.malformed = malformed
    for batch, time_us, size in received:
        stats.add(batch, time_us, size)
    return stats


def render(report: dict[str, Any]) -> list[str]:
    """The text tables of a :meth:`StreamStats.to_json` report."""
    from kvevents.commands._format import format_time_us

    r = report["range"]
    lines = [
        f"topic {report['topic']}: {r['batches']:,} batches, {r['bytes'] / 1e6:,.2f} MB, {r['seconds']:.3f} s "
        f"from {format_time_us(r['first_us'] or 0)} to {format_time_us(r['last_us'] or 0)}"
        + (" (interrupted)" if report.get("interrupted") else ""),
        "",
        f"{'event type':<12} {'events':>10} {'per second':>12}",
    ]
    for kind, count in report["events"].items():
        lines.append(f"{kind:<12} {count:>10,} {report['rates_per_s'][kind]:>12,.1f}")
    lines.append(
        f"{'all':<12} {sum(report['events'].values()):>10,} {sum(report['rates_per_s'].values()):>12,.1f}"
    )
    moves = report["level_moves"]
    others = {k: v for k, v in moves["all"].items() if k not in ("0->1", "1->0")}
    lines += [
        "",
        f"cache-level moves: primary->secondary {moves['primary_to_secondary']:,}, "
        f"secondary->primary {moves['secondary_to_primary']:,}"
        + (f", others {others}" if others else "")
        + f"; priority changes {moves['priority_changes']:,}",
    ]
    life = report["block_lifetimes"]
    lines.append(
        f"block lifetimes (Stored -> Removed, {life['count']:,} blocks): p50 {life['p50_s']:.3f} s, "
        f"p90 {life['p90_s']:.3f} s, p99 {life['p99_s']:.3f} s, max {life['max_s']:.3f} s; "
        f"{life['still_held']:,} still held, {life['removed_without_store_in_range']:,} removed without "
        f"their Stored in range, {life['ended_by_created']:,} ended by a Created event"
        + (" (percentiles from a uniform sample of them)" if life["percentiles_sampled"] else "")
    )
    reuse = report["prefix_reuse"]
    lines.append(
        f"prefix reuse: {reuse['already_stored_by_another_worker']:,} of {reuse['stored_blocks']:,} stored blocks "
        f"({reuse['share'] * 100:.1f}%) were already stored by another worker; "
        f"{reuse['parent_stored_by_another_worker']:,} of {reuse['stored_events_with_parent']:,} Stored events "
        f"continue a prefix another worker stored; {reuse['stored_again_by_the_same_worker']:,} blocks "
        f"stored again by the same worker"
        + (
            f" ({reuse['block_hashes_forgotten']:,} block hashes stored long ago forgotten: their reuse is not counted)"
            if reuse["block_hashes_forgotten"]
            else ""
        )
    )
    gaps = report["drops_and_gaps"]
    lines.append(
        f"drops and gaps: {gaps['dropped_events']:,} events dropped in-band, {gaps['missing_batches']:,} missing "
        f"batches, {gaps['event_ids_skipped']:,} event ids skipped, {gaps['replayed_batches']:,} replayed "
        f"batches, {gaps['replayed_events']:,} replayed events, {gaps['malformed_messages']:,} malformed messages"
    )
    for title, key in (
        ("dropped", "dropped_by_worker"),
        ("event ids skipped", "event_ids_skipped_by_worker"),
    ):
        if gaps[key]:
            lines.append(
                f"  {title}: " + ", ".join(f"{printable(str(w))} {n:,}" for w, n in gaps[key].items())
            )
    if gaps["missing_batches_by_instance"]:
        lines.append(
            "  missing batches: "
            + ", ".join(f"{printable(str(i))} {n:,}" for i, n in gaps["missing_batches_by_instance"].items())
        )
    if report.get("plot"):
        lines.append(f"plot: {report['plot']}")
    return lines


def _require_matplotlib() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise CommandError(
            "--plot needs matplotlib, which is not installed: pip install 'kvevents[cli]' (or matplotlib)",
            code=2,
        ) from None


def _plot(stats: StreamStats, path: Path, topic: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    times, rates = stats.series()
    figure, axes = plt.subplots(figsize=(10, 4.5), dpi=100)
    for kind, values in rates.items():
        axes.plot(times, values, label=kind, linewidth=1.4)
    axes.set_xlabel(f"seconds since the first batch (buckets of {stats.bucket_s * stats.series_step():g} s)")
    axes.set_ylabel("events per second")
    axes.set_title(f"kvevents: event rates by type, topic {topic}")
    axes.grid(True, alpha=0.3)
    axes.legend(loc="upper right")
    figure.tight_layout()
    try:
        figure.savefig(path, format="png")
    except OSError as exc:
        raise CommandError(f"cannot write the plot to {path}: {exc.strerror or exc}") from exc
    finally:
        plt.close(figure)
