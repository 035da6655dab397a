"""``kvevents index``: rebuild the global cache index from the topic (or keep tailing it),
with checkpoints, a table of workers, and a check against the simulators' ground truth."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any, TextIO

from kvevents.commands._common import (
    EXIT_INTERRUPTED,
    CommandError,
    Interrupted,
    Progress,
    add_kafka_flags,
    add_output_flags,
    command,
    stop_on_interrupt,
)
from kvevents.commands._index_build import (
    Built,
    add_index_flags,
    build_index,
    capture_and_save,
    catch_up_with_topic,
)
from kvevents.commands._shutdown import sigterm_as_sigint

DESCRIPTION = """\
Rebuild the global KV-cache index from the events topic and show its workers: blocks per
cache level and window size, degraded workers (their view may be incomplete: events were
lost, and why), the last event id applied, and the reader's lag.

Without --tail: read up to the end of the topic as it is at start, print the table and a
summary, and exit. With --tail: keep following the topic, redrawing the table (in place on a
terminal, every --refresh seconds otherwise) until Ctrl-C or --duration.

Checkpoints (index state + offsets) make restarts fast: --checkpoint FILE starts from a file
and catches up from its offsets; --save-checkpoint FILE writes one at the end (and every
--checkpoint-interval seconds with --tail); --checkpoint-topic keeps them in a compacted Kafka
topic instead. --verify GROUND_TRUTH.jsonl compares the index with the simulators' ground
truth (exit code 1 when they differ).
"""

EPILOG = """\
examples:
  kvevents index                                         # rebuild, print the table
  kvevents index --save-checkpoint idx.ckpt              # ... and save a checkpoint
  kvevents index --checkpoint idx.ckpt --tail            # restart from it and keep following
  kvevents index --checkpoint-topic kv-index-checkpoints --tail --checkpoint-interval 60
  kvevents index --verify truth.jsonl --json | jq .verify.equal

exit codes: 0 done, 1 error or --verify found a difference, 130 interrupted (Ctrl-C)
"""


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``index``."""
    parser = subparsers.add_parser(
        "index",
        help="rebuild (or tail) the global cache index; checkpoints, worker table, --verify",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_kafka_flags(parser)
    add_index_flags(parser)
    parser.add_argument(
        "--save-checkpoint",
        type=Path,
        default=None,
        metavar="FILE",
        help="write a checkpoint file at the end",
    )
    live = parser.add_argument_group("following")
    live.add_argument("--tail", action="store_true", help="after the rebuild, keep following the topic")
    live.add_argument(
        "--duration", type=float, default=None, help="with --tail: stop after this many seconds"
    )
    live.add_argument(
        "--refresh",
        type=float,
        default=None,
        help="seconds between table updates (default: 1 on a terminal, 10 otherwise)",
    )
    live.add_argument(
        "--checkpoint-interval",
        type=float,
        default=None,
        metavar="SECONDS",
        help="with --tail: also save the checkpoint(s) this often",
    )
    parser.add_argument(
        "--verify",
        type=Path,
        default=None,
        metavar="GROUND_TRUTH.jsonl",
        help="compare the index with this ground truth (JSON lines of the simulators' GroundTruth)",
    )
    add_output_flags(parser, json_help="print the final summary, workers and verification as one JSON object")
    parser.set_defaults(func=run)


class LiveTable:
    """Redraws lines in place on a terminal; prints them as a new block otherwise."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream
        self.tty = bool(getattr(stream, "isatty", lambda: False)())
        self._drawn = 0

    def draw(self, lines: list[str]) -> None:
        if self.tty:
            if self._drawn:
                self.stream.write(f"\x1b[{self._drawn}F\x1b[J")
            self._drawn = len(lines)
        else:
            lines = [f"[{time.strftime('%H:%M:%S')}]", *lines, ""]
        self.stream.write("\n".join(lines) + "\n")
        self.stream.flush()


def _table_lines(built: Built) -> list[str]:
    from kvevents.commands._workers_view import index_summary, render_workers, worker_rows

    return render_workers(worker_rows(built.index), index_summary(built.index, built.reader.metrics()))


def _follow(args: argparse.Namespace, built: Built, show: Progress, interrupted: Interrupted) -> list[str]:
    """Tail until Ctrl-C or --duration; returns the lines of the checkpoints saved meanwhile."""
    refresh = args.refresh if args.refresh is not None else (1.0 if sys.stdout.isatty() else 10.0)
    table = None if args.json else LiveTable(sys.stdout)
    started = last_save = time.monotonic()
    saved: list[str] = []
    while not interrupted:
        wait = refresh
        if args.duration is not None:
            wait = min(wait, started + args.duration - time.monotonic())
            if wait <= 0:
                return saved
        built.apply(until_caught_up=False, timeout=wait)
        if table is not None:
            table.draw(_table_lines(built))
        else:
            metrics = built.reader.metrics()
            show.update(
                f"tailing: {metrics.events_total:,} events read, lag {metrics.lag_total:,} msgs", force=True
            )
        if args.checkpoint_interval and time.monotonic() - last_save >= args.checkpoint_interval:
            saved = capture_and_save(args, built)
            last_save = time.monotonic()
            for line in saved:
                show.update(line, force=True)
    return saved


@command("index")
def run(args: argparse.Namespace) -> int:
    """Run ``kvevents index``."""
    from kvevents.commands._workers_view import index_summary, render_workers, worker_rows
    from kvevents.verify import compare, load_ground_truth

    for name in ("duration", "refresh", "checkpoint_interval"):
        value = getattr(args, name)
        if value is not None and value <= 0:
            raise CommandError(f"--{name.replace('_', '-')} must be > 0, got {value}", code=2)
    truths = None
    if args.verify is not None:
        try:
            truths = load_ground_truth(args.verify)
        except ValueError as exc:
            raise CommandError(str(exc), code=2) from exc
    show = Progress(enabled=not args.quiet)
    built = build_index(args, catch_up=False)
    try:
        with stop_on_interrupt(built.reader.stop) as interrupted, sigterm_as_sigint():
            catch_up_with_topic(built, show)
            show.done()
            if args.tail and not interrupted:
                _follow(args, built, show, interrupted)
        saved = capture_and_save(args, built)
        metrics = built.reader.metrics()
    finally:
        built.close()
    rows = worker_rows(built.index)
    summary = index_summary(built.index, metrics)
    summary.update(source=built.source, topic=args.topic, interrupted=bool(interrupted))
    if built.result is not None:
        summary["rebuild"] = {
            "messages": built.result.messages,
            "events": built.result.events,
            "bytes": built.result.bytes,
            "seconds": round(built.result.seconds, 3),
            "events_per_s": round(built.result.events_per_s, 1),
        }
    report = compare(built.index, truths) if truths is not None else None
    if args.json:
        out: dict[str, Any] = {"summary": summary, "workers": rows, "checkpoints": saved}
        if report is not None:
            out["verify"] = report.to_json()
        print(json.dumps(out))
    else:
        if built.result is not None:
            r = built.result
            print(
                f"index of {args.topic!r} from {built.source}: {r.messages:,} messages, {r.events:,} events, "
                f"{r.bytes / 1e6:,.1f} MB in {r.seconds:.2f} s ({r.events_per_s:,.0f} events/s)"
            )
        print("\n".join(render_workers(rows, summary)))
        if interrupted:
            print("interrupted: the index holds what was applied before Ctrl-C")
        for line in saved:
            print(line)
        if report is not None:
            print("verify: " + report.describe())
    if interrupted:
        return EXIT_INTERRUPTED
    return 1 if report is not None and not report.equal else 0
