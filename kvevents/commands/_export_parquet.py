"""``kvevents export parquet``: the topic as one row per block event in a Parquet directory."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from kvevents.commands._common import (
    EXIT_INTERRUPTED,
    CommandError,
    Progress,
    add_kafka_flags,
    add_output_flags,
    command,
    kafka_config,
    reader_codec,
    resolve_bootstrap,
    stop_on_interrupt,
)

DESCRIPTION = """\
Write the events of a kvevents topic into DIR as Parquet: one row per block event (a Stored
event gives a row per block, a Removed event a row per hash; Updated, Created and in-band loss
reports a row each) with the instance, attention-DP rank, window, event type, cache level
before/after, block hash, parent hash, token count, LoRA id, event id, the batch's creation
time and the Kafka partition, offset and timestamp. Files are partitioned hive-style by date
(UTC, of the Kafka timestamp) and instance:

  DIR/date=2026-12-03/instance=sim-0/part-00000000.parquet

The export resumes: DIR/_kvevents_export.json holds the next offset per partition, written
only after the Parquet files it covers are closed; a re-run (after Ctrl-C, a crash or a kill)
writes only what is new, never a row twice. Malformed messages are counted, listed in
DIR/_malformed.jsonl, and skipped. Progress goes to stderr, the summary to stdout.
Hashes are signed 64-bit (Avro's long); docs/ANALYTICS.md has DuckDB recipes.
"""

EPILOG = """\
examples:
  kvevents export parquet events/                       # the topic so far, then exit
  kvevents export parquet events/ --follow              # keep exporting (Ctrl-C ends cleanly)
  duckdb -c "SELECT instance, count(*) FROM read_parquet('events/**/*.parquet', hive_partitioning=true) GROUP BY 1"
"""


def register_export(formats: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``export parquet``."""
    parser = formats.add_parser(
        "parquet",
        help="one row per block event into hive-partitioned Parquet (date, instance), resumable",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("out", type=Path, metavar="DIR", help="the export directory (created if missing)")
    parser.add_argument(
        "--follow",
        "-f",
        action="store_true",
        help="keep exporting new events until Ctrl-C (default: stop when caught up)",
    )
    parser.add_argument(
        "--rows-per-file",
        type=int,
        default=1_000_000,
        metavar="N",
        help="close a chunk of files after N rows (default: 1000000)",
    )
    parser.add_argument(
        "--flush-interval",
        type=float,
        default=30.0,
        metavar="SECONDS",
        help="close a chunk at least this often, so --follow's files and state stay fresh (default: 30)",
    )
    parser.add_argument(
        "--max-messages", type=int, default=None, metavar="N", help="stop after N Kafka messages"
    )
    add_kafka_flags(parser)
    add_output_flags(parser, json_help="print the summary as JSON")
    parser.set_defaults(func=run)


@command("export parquet")
def run(args: argparse.Namespace) -> int:
    """Run ``kvevents export parquet``."""
    try:
        from kvevents.analytics.exporter import export_parquet
    except ImportError as exc:
        raise CommandError(
            f"{exc.name or 'pyarrow'} is missing: install the analytics extra (pip install 'kvevents[analytics]')"
        ) from exc
    from kvevents.consumer import EventReader, ReaderError

    from kvevents.analytics.exporter import ExportProgress

    if args.rows_per_file < 1 or args.flush_interval <= 0:
        raise CommandError("--rows-per-file must be >= 1 and --flush-interval > 0")
    bootstrap = resolve_bootstrap(args)
    show = Progress(enabled=not args.quiet)
    readers: list[EventReader] = []

    def progress(p: ExportProgress) -> None:
        show.update(
            f"exporting {args.topic}: {p.messages:,} messages, {p.rows:,} rows "
            f"({p.rows_per_s:,.0f} rows/s), lag {p.lag:,} messages, malformed {p.malformed}",
        )

    def stop() -> None:
        for reader in readers:
            reader.stop()

    try:
        with stop_on_interrupt(stop) as interrupted:
            result = export_parquet(
                bootstrap,
                args.topic,
                args.out,
                follow=args.follow,
                rows_per_chunk=args.rows_per_file,
                flush_interval_s=args.flush_interval,
                max_messages=args.max_messages,
                config=kafka_config(args),
                progress=progress,
                on_reader=readers.append,
                codec=reader_codec(args),
            )
    except (ReaderError, ValueError) as exc:
        raise CommandError(str(exc)) from exc
    show.done()
    summary = {
        "topic": args.topic,
        "out": str(args.out),
        "messages": result.messages,
        "rows": result.rows,
        "malformed": result.malformed,
        "chunks": result.chunks,
        "seconds": round(result.seconds, 3),
        "rows_per_s": round(result.rows_per_s),
        "rows_in_directory": result.files_rows,
        "next_offsets": {str(p): o for p, o in result.offsets.items()},
        "leftovers_removed": result.leftovers_removed,
        "caught_up": result.caught_up,
        "interrupted": bool(interrupted),
    }
    if args.json:
        print(json.dumps(summary))
    else:
        print(
            f"exported {result.messages:,} messages as {result.rows:,} rows into {args.out} "
            f"in {result.seconds:.1f}s ({result.rows_per_s:,.0f} rows/s); "
            f"{result.files_rows:,} rows in the directory; malformed {result.malformed}"
        )
        if result.leftovers_removed:
            print(
                f"removed {result.leftovers_removed} file(s) of a run that stopped before saving its state",
                file=sys.stderr,
            )
    return EXIT_INTERRUPTED if interrupted else 0
