"""``kvevents report``: the cache analysis of a topic (or of its Parquet export) as tables,
a PNG of plots and one HTML page."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from kvevents.commands._common import (
    CommandError,
    Progress,
    add_kafka_flags,
    add_output_flags,
    check_kafka,
    command,
    kafka_config,
    reader_codec,
    resolve_bootstrap,
)

DESCRIPTION = """\
Analyse the KV-cache events of a topic, or of a directory written by 'kvevents export parquet'
(--parquet DIR, no Kafka needed), and print:

  events        counts and rates per event type
  prefix reuse  stored blocks another worker had already stored (engine hashes)
  lifetimes     seconds from a block's Stored to its Removed event on the same worker
  tiers         evicted blocks per cache tier (the block's level when removed), offloads, onboards
  hit rate      each Stored event replayed as a request for its block chain against the index
                as it was just before: the blocks a cache-aware router would have found cached
                (the worker with the longest leading run), round-robin (the mean over workers),
                and what the observed placement found
  loss          dropped events, missing batches, skipped event ids, and per worker the time its
                view was degraded (from a detected loss to the Created event or snapshot that
                rebuilt it)

--png and --html save the plots and a self-contained page (tables and plots, no other file).
The topic is read from the beginning until caught up. Progress on stderr, results on stdout.
"""

EPILOG = """\
examples:
  kvevents report --png report.png --html report.html
  kvevents report --parquet events/ --json | jq .routing
"""


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``report``."""
    parser = subparsers.add_parser(
        "report",
        help="cache analysis of the topic or a Parquet export: tables, PNG plots, one HTML page",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--parquet",
        type=Path,
        default=None,
        metavar="DIR",
        help="read a 'kvevents export parquet' directory instead of the topic",
    )
    parser.add_argument("--png", type=Path, default=None, metavar="FILE", help="save the plots as a PNG")
    parser.add_argument(
        "--html", type=Path, default=None, metavar="FILE", help="save one self-contained HTML page"
    )
    add_kafka_flags(parser)
    add_output_flags(parser, json_help="print the report as JSON")
    parser.set_defaults(func=run)


@command("report")
def run(args: argparse.Namespace) -> int:
    """Run ``kvevents report``."""
    try:
        from kvevents.analytics.report import CacheReport
        from kvevents.analytics.report_render import render_html, render_png, render_text
        from kvevents.analytics.source import batches_from_table, read_parquet_dir, read_topic
    except ImportError as exc:
        raise CommandError(
            f"{exc.name} is missing: install the analytics extra (pip install 'kvevents[analytics]')"
        ) from exc
    if args.png is not None or args.html is not None:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise CommandError(
                "--png/--html need matplotlib: pip install 'kvevents[analytics]'", code=2
            ) from None
    from kvevents.consumer import ReaderError
    from kvevents.schemas import LimitError

    show = Progress(enabled=not args.quiet)
    malformed = 0

    def set_aside(partition: int, offset: int, error: str) -> None:
        nonlocal malformed
        malformed += 1
        print(
            f"kvevents report: malformed message at {args.topic}[{partition}]@{offset}: {error}",
            file=sys.stderr,
        )

    if args.parquet is not None:
        source = f"Parquet export {args.parquet}"
        try:
            reads = batches_from_table(read_parquet_dir(args.parquet))
        except (OSError, ValueError) as exc:
            raise CommandError(str(exc)) from exc

        malformed = _exported_malformed(args.parquet)
    else:
        source = f"topic {args.topic}"
        bootstrap = resolve_bootstrap(args)
        check_kafka(args, bootstrap, topic=args.topic)  # no broker or no topic: one line, as stats says it
        reads = read_topic(
            bootstrap,
            args.topic,
            config=kafka_config(args),
            on_malformed=set_aside,
            codec=reader_codec(args),
        )
    cache = CacheReport()
    try:
        for count, read in enumerate(reads, 1):
            try:
                cache.add(read)
            except LimitError as exc:  # decodes, but no index takes it: set aside like a malformed one
                set_aside(read.partition, read.offset, str(exc))
                continue
            if show.due():
                show.update(
                    f"reading {source}: {count:,} batches, partition {read.partition} offset {read.offset}"
                )
    except ReaderError as exc:
        raise CommandError(str(exc)) from exc
    show.done()
    cache.stats.malformed = malformed
    report = cache.to_json()
    report["source"] = source
    title = f"kvevents cache report: {source}"
    png = render_png(cache, report, title) if (args.png is not None or args.html is not None) else None
    try:
        if args.png is not None and png is not None:
            args.png.write_bytes(png)
            report["png"] = str(args.png)
        if args.html is not None:
            args.html.write_text(render_html(report, png, title))
            report["html"] = str(args.html)
    except OSError as exc:
        raise CommandError(f"cannot write the report: {exc}") from exc
    if args.json:
        print(json.dumps(report))
    else:
        print(title)
        print("\n".join(render_text(report)))
    return 0


def _exported_malformed(directory: Path) -> int:
    """Messages an export set aside: its state file's count ('export parquet') or the lines of
    ``_spark_malformed`` (the Spark job)."""
    state_file = directory / "_kvevents_export.json"
    try:
        if state_file.exists():
            return int(json.loads(state_file.read_text()).get("malformed", 0))
        return sum(len(f.read_text().splitlines()) for f in (directory / "_spark_malformed").glob("part-*"))
    except (OSError, ValueError) as exc:
        raise CommandError(f"cannot read what {directory} set aside: {exc}") from exc
