"""``kvevents tail``: decoded events of the topic, one line each (or JSON), like kcat with the
Avro contract."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TextIO

from kvevents.commands._common import (
    EXIT_INTERRUPTED,
    CommandError,
    add_kafka_flags,
    add_output_flags,
    check_kafka,
    command,
    kafka_config,
    reader_codec,
    resolve_bootstrap,
    stop_on_interrupt,
)
from kvevents.commands._format import EVENT_TYPES

if TYPE_CHECKING:
    from kvevents.commands._stream import Received

DESCRIPTION = """\
Print the events of a kvevents topic, decoded: one line per event

  TIME INSTANCE rRANK #EVENT_ID TYPE w=WINDOW SUMMARY

(TIME is the batch's creation time, UTC; SUMMARY: block hashes, cache levels, token counts),
and one '-- ... batch' line per batch with its sequence number and the drops its producer
reported in-band (DROPPED r1:5 = rank 1 lost 5 events). A jump in an instance's batch
sequence is flagged on that line. --json prints one JSON object per line instead
("kind": "event" or "batch"). Malformed messages are reported on stderr with their partition
and offset, counted, and skipped.
"""

EPILOG = """\
examples:
  kvevents tail                                   # new events from now on (Ctrl-C stops)
  kvevents tail --from-beginning --no-follow      # the whole topic, then exit
  kvevents tail --from-beginning --count 20 --type stored --instance sim-0 --rank 1
  kvevents tail --json --no-batches | jq .type
"""


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``tail``."""
    parser = subparsers.add_parser(
        "tail",
        help="print decoded events of the topic (like kcat), with filters",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_kafka_flags(parser)
    where = parser.add_argument_group("what to read")
    where.add_argument(
        "--from-beginning",
        action="store_true",
        help="start at the oldest retained message (default: the end)",
    )
    where.add_argument(
        "--follow",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="keep waiting for new events (default); --no-follow stops once caught up with the "
        "end of the topic as it was at start",
    )
    where.add_argument("--count", "-n", type=int, default=None, help="stop after printing N events")
    filters = parser.add_argument_group("filters (repeatable; events must pass every kind given)")
    filters.add_argument("--instance", action="append", default=[], help="only this engine instance id")
    filters.add_argument("--rank", type=int, action="append", default=[], help="only this attention-DP rank")
    filters.add_argument(
        "--type", action="append", default=[], choices=EVENT_TYPES, help="only events of this type"
    )
    filters.add_argument("--no-batches", action="store_true", help="no batch lines (events only)")
    add_output_flags(parser, json_help="one JSON object per line")
    parser.set_defaults(func=run)


@dataclass
class EventFilter:
    """Which events to show (empty sets pass everything)."""

    instances: frozenset[str] = frozenset()
    ranks: frozenset[int] = frozenset()
    types: frozenset[str] = frozenset()

    def instance_ok(self, instance_id: str) -> bool:
        return not self.instances or instance_id in self.instances

    def event_ok(self, rank: int, kind: str) -> bool:
        return (not self.ranks or rank in self.ranks) and (not self.types or kind in self.types)


@dataclass
class SequenceTracker:
    """Per instance, the last batch sequence of its current producer; says when it jumps."""

    last: dict[str, tuple[int, int]] = field(default_factory=dict)

    def note(self, instance_id: str, producer_id: int, sequence: int) -> str:
        previous = self.last.get(instance_id)
        self.last[instance_id] = (producer_id, sequence)
        if previous is None:
            return ""
        if previous[0] != producer_id:
            return f"NEW-PRODUCER (was {previous[0]})"
        if sequence > previous[1] + 1:
            return f"SEQUENCE-GAP ({sequence - previous[1] - 1} batch(es) missing after seq={previous[1]})"
        if sequence <= previous[1]:
            return "REPLAY"
        return ""


@dataclass
class TailCounts:
    batches: int = 0
    events: int = 0
    shown: int = 0
    malformed: int = 0


class TailPrinter:
    """Filters and prints received batches; counts what it saw."""

    def __init__(
        self,
        event_filter: EventFilter,
        *,
        as_json: bool,
        batches: bool,
        count: int | None,
        out: TextIO | None = None,
    ) -> None:
        self.filter = event_filter
        self.as_json = as_json
        self.batches = batches
        self.count = count
        self.out = out if out is not None else sys.stdout
        self.counts = TailCounts()
        self.sequences = SequenceTracker()

    @property
    def done(self) -> bool:
        return self.count is not None and self.counts.shown >= self.count

    def receive(self, received: Received) -> None:
        """Print what passes the filters of one :class:`~kvevents.commands._stream.Received`."""
        from kvevents.commands._format import batch_json, batch_line, event_json, event_line, event_type

        batch = received.batch
        self.counts.batches += 1
        self.counts.events += len(batch.events)
        note = self.sequences.note(batch.instance_id, batch.producer_id, batch.sequence)
        if not self.filter.instance_ok(batch.instance_id):
            return
        time_us = received.time_us
        lines: list[str] = []
        for event in batch.events:
            if self.done:
                break
            rank = 0 if event.attention_dp_rank is None else event.attention_dp_rank
            if not self.filter.event_ok(rank, event_type(event)):
                continue
            if self.as_json:
                lines.append(
                    json.dumps(event_json(batch, event, time_us, received.partition, received.offset))
                )
            else:
                lines.append(event_line(batch, event, time_us))
            self.counts.shown += 1
        drops = any(
            d.dropped_events > 0 and (not self.filter.ranks or d.attention_dp_rank in self.filter.ranks)
            for d in batch.dropped
        )
        if self.batches and (lines or drops or note):
            if self.as_json:
                header = json.dumps(batch_json(batch, received.partition, received.offset, time_us, note))
            else:
                header = batch_line(batch, received.partition, received.offset, time_us, note)
            lines.insert(0, header)
        if lines:
            self.out.write("\n".join(lines) + "\n")
            self.out.flush()


@command("tail")
def run(args: argparse.Namespace) -> int:
    """Run ``kvevents tail``."""
    from kvevents.consumer import EventReader, ReaderError

    from kvevents.commands._stream import Malformed, decoded_messages

    if args.count is not None and args.count < 1:
        raise CommandError("--count must be >= 1", code=2)
    bootstrap = resolve_bootstrap(args)
    printer = TailPrinter(
        EventFilter(frozenset(args.instance), frozenset(args.rank), frozenset(args.type)),
        as_json=args.json,
        batches=not args.no_batches,
        count=args.count,
    )

    def malformed(bad: Malformed) -> None:
        printer.counts.malformed += 1
        print(f"kvevents tail: {bad.describe(args.topic)}", file=sys.stderr, flush=True)

    check_kafka(args, bootstrap, topic=args.topic)
    try:
        reader = EventReader(
            bootstrap,
            args.topic,
            start="beginning" if args.from_beginning else "end",
            config=kafka_config(args),
            consume_batch=500,
            codec=reader_codec(args),
        )
    except (ReaderError, ValueError) as exc:
        raise CommandError(str(exc)) from exc
    try:
        with stop_on_interrupt(reader.stop) as interrupted:
            for received in decoded_messages(reader, follow=args.follow, on_malformed=malformed):
                printer.receive(received)
                if printer.done:
                    break
    except ReaderError as exc:
        raise CommandError(str(exc)) from exc
    finally:
        reader.close()
    counts = printer.counts
    if not args.quiet:
        print(
            f"kvevents tail: {counts.shown} event(s) shown of {counts.events} in {counts.batches} batch(es), "
            f"{counts.malformed} malformed message(s)" + (" (interrupted)" if interrupted else ""),
            file=sys.stderr,
        )
    return EXIT_INTERRUPTED if interrupted else 0
