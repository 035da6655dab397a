"""``kvevents tail``'s lines and JSON, filters, batch lines and sequence checks (no Kafka)."""

from __future__ import annotations

import io
import json

from cli_events import batch, created, removed, stored, updated

from kvevents.commands._format import batch_line, event_json, event_line, format_time_us, printable
from kvevents.commands._stream import Malformed, Received
from kvevents.commands.tail import EventFilter, SequenceTracker, TailPrinter

T = 1_796_000_000_123_456  # 20787 days + 3200.123456 s after the epoch


def received(b, offset: int = 0) -> Received:  # type: ignore[no-untyped-def]
    return Received(b, partition=1, offset=offset, timestamp_ms=None, size=10)


def test_time_is_utc_iso_with_milliseconds() -> None:
    assert format_time_us(T) == "2026-11-30T00:53:20.123Z"
    assert format_time_us(0) == "-"


def test_a_time_past_any_date_is_shown_as_its_number_not_a_crash() -> None:
    """A producer may write any created_at_us: year 10000 and on made tail, stats and report
    raise ValueError."""
    for time_us in (253_402_300_800_000_000, 2**62, 2**63 - 1):
        assert format_time_us(time_us) == f"@{time_us}us"
    assert event_line(batch([], 0), created(0), 2**62).startswith(f"@{2**62}us i0 ")


def test_control_characters_of_an_instance_id_are_escaped_in_text_lines() -> None:
    """An instance id is whatever a producer wrote: an ANSI escape or a newline in it would
    rewrite the terminal or forge a line of its own."""
    hostile = "\x1b[2Jengine\r\nforged line"
    b = batch([], 0, instance=hostile)
    for line in (event_line(b, created(0), T), batch_line(b, 1, 0, T)):
        assert "\x1b" not in line and "\n" not in line and "\r" not in line
        assert "\\x1b[2Jengine\\r\\nforged line" in line
    assert printable("engine-0 é") == "engine-0 é"


def test_each_event_type_has_a_summary_line() -> None:
    b = batch([], 0)
    assert event_line(b, created(0, rank=1), T).endswith("i0 r1 #0 created w=64 blocks_per_level=100,10")
    line = event_line(b, stored(3, [0xA, 0xB, 0xC, 0xD, 0xE, 0xF], parent=0x9, level=1), T)
    assert "#3 stored w=64 parent=0x0000000000000009 blocks=6 tokens=24 levels=1,1,1,1,1,1" in line
    assert "hashes=0x000000000000000a,0x000000000000000b,0x000000000000000c,0x000000000000000d,+2" in line
    assert event_line(b, removed(4, [0xA]), T).endswith("#4 removed w=64 blocks=1 hashes=0x000000000000000a")
    line = event_line(b, updated(5, 0xB, level=(0, 1), priority=(35, 80)), T)
    assert line.endswith("#5 updated w=64 block=0x000000000000000b level 0->1 priority 35->80")


def test_batch_line_shows_sequence_and_in_band_drops() -> None:
    b = batch([created(0)], 12, dropped=[(1, 5), (0, 0)])
    line = batch_line(b, 2, 40, T, "SEQUENCE-GAP (1 batch(es) missing after seq=10)")
    assert line.startswith("-- 2026-11-30T00:53:20.123Z i0 batch seq=12 producer=7 events=1 dp=2 at p2@40")
    assert "DROPPED r1:5" in line and "r0:" not in line and line.endswith("seq=10)")


def test_event_json_keeps_full_hashes_in_the_text_form() -> None:
    big = (1 << 64) - 1
    b = batch([], 3)
    data = event_json(b, stored(1, [big], parent=big - 1), T, 0, 9)
    assert json.loads(json.dumps(data)) == data
    assert data["data"]["blocks"][0]["block_hash"] == "0xffffffffffffffff"
    assert int(data["data"]["parent_hash"], 16) == big - 1
    assert (data["type"], data["batch_sequence"], data["offset"]) == ("stored", 3, 9)
    # the same spelling as the text line, for every kind of hash
    assert f"parent={data['data']['parent_hash']}" in event_line(b, stored(1, [big], parent=big - 1), T)
    assert event_json(b, removed(2, [0xA]), T, 0, 1)["data"]["block_hashes"] == ["0x000000000000000a"]
    assert event_json(b, updated(3, 0xB, level=(0, 1)), T, 0, 1)["data"]["block_hash"] == "0x000000000000000b"
    assert event_json(b, stored(4, [1]), T, 0, 1)["data"]["parent_hash"] is None


def test_sequence_tracker_flags_gaps_new_producers_and_replays() -> None:
    tracker = SequenceTracker()
    assert tracker.note("a", 1, 0) == ""
    assert tracker.note("a", 1, 1) == ""
    assert tracker.note("a", 1, 4).startswith("SEQUENCE-GAP (2 batch(es)")
    assert tracker.note("a", 1, 4) == "REPLAY"
    assert tracker.note("a", 2, 0).startswith("NEW-PRODUCER")
    assert tracker.note("b", 1, 9) == ""


def test_printer_filters_by_instance_rank_and_type_and_counts() -> None:
    out = io.StringIO()
    printer = TailPrinter(
        EventFilter(frozenset({"i0"}), frozenset({1}), frozenset({"stored"})), as_json=False, batches=True,
        count=None, out=out,
    )  # fmt: skip
    printer.receive(
        received(batch([stored(0, [1], rank=0), stored(0, [2], rank=1), removed(1, [2], rank=1)], 0))
    )
    printer.receive(received(batch([stored(0, [3], rank=1)], 0, instance="other")))
    printer.receive(received(batch([removed(2, [5], rank=1)], 1)))  # nothing passes, no drops: no line
    lines = out.getvalue().splitlines()
    assert len(lines) == 2 and lines[0].startswith("-- ") and " r1 #0 stored " in lines[1]
    assert (printer.counts.batches, printer.counts.events, printer.counts.shown) == (3, 5, 1)


def test_printer_shows_a_batch_with_drops_even_without_matching_events() -> None:
    out = io.StringIO()
    printer = TailPrinter(
        EventFilter(types=frozenset({"created"})), as_json=True, batches=True, count=None, out=out
    )
    printer.receive(received(batch([stored(0, [1])], 0, dropped=[(1, 3)])))
    (line,) = out.getvalue().splitlines()
    assert json.loads(line)["kind"] == "batch" and json.loads(line)["dropped"] == {"1": 3}


def test_printer_stops_at_count_and_can_hide_batch_lines() -> None:
    out = io.StringIO()
    printer = TailPrinter(EventFilter(), as_json=True, batches=False, count=2, out=out)
    printer.receive(received(batch([created(0), stored(1, [1]), removed(2, [1])], 0)))
    rows = [json.loads(line) for line in out.getvalue().splitlines()]
    assert [r["type"] for r in rows] == ["created", "stored"] and printer.done


def test_malformed_description_names_partition_offset_and_key() -> None:
    bad = Malformed(3, 17, b"engine-a", 5, "not a kvevents batch")
    assert bad.describe("t") == "malformed message at t[3]@17 (key 'engine-a'), 5 bytes: not a kvevents batch"
