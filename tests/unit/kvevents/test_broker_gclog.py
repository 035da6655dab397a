"""The broker's GC log: the flag that writes it, and reading its pauses back."""

from __future__ import annotations

import subprocess
from datetime import datetime
from pathlib import Path
from typing import Any

from kvevents.broker.gclog import GcPause, gc_log_option, pauses_between, read_gc_pauses, request_full_gc
from kvevents.broker.process import FAST_START_JVM_OPTIONS, LocalBroker, find_java

# Lines as JDK 17 writes them with -Xlog:gc:file=...:time, one collector each.
SERIAL = """\
[2026-12-07T00:27:37.869+0000] Using Serial
[2026-12-07T00:27:37.941+0000] GC(0) Pause Young (Allocation Failure) 68M->1M(247M) 1.577ms
[2026-12-07T00:27:38.100+0000] GC(1) Pause Full (Metadata GC Threshold) 94M->21M(365M) 67.031ms
"""
G1 = "[2026-12-07T00:27:38.184+0000] GC(0) Pause Young (Normal) (G1 Evacuation Pause) 12M->1M(256M) 0.754ms\n"
SHENANDOAH = """\
[2026-12-07T00:27:38.519+0000] Heuristics ergonomically sets -XX:+ExplicitGCInvokesConcurrent
[2026-12-07T00:27:38.609+0000] GC(0) Pause Init Mark 0.036ms
[2026-12-07T00:27:38.700+0000] GC(0) Concurrent marking 20M->21M(256M) 9.100ms
[2026-12-07T09:27:38.800+0900] GC(0) Pause Final Mark 0.500ms
"""


def unix(text: str) -> float:
    return datetime.strptime(text, "%Y-%m-%dT%H:%M:%S.%f%z").timestamp()


def test_pauses_of_every_collector_are_read_and_the_rest_skipped(tmp_path: Path) -> None:
    log = tmp_path / "gc.log"
    log.write_text(SERIAL + G1 + SHENANDOAH)
    pauses = read_gc_pauses(log)
    assert [(p.kind, p.ms) for p in pauses] == [
        ("Pause Young", 1.577),
        ("Pause Full", 67.031),
        ("Pause Young", 0.754),
        ("Pause Init Mark", 0.036),
        ("Pause Final Mark", 0.5),  # a concurrent phase is not a pause
    ]
    assert pauses[1].end_s == unix("2026-12-07T00:27:38.100+0000")
    assert pauses[4].end_s == unix("2026-12-07T00:27:38.800+0000"), "the offset is honoured"
    assert abs(pauses[1].start_s - (pauses[1].end_s - 0.067031)) < 1e-9


def test_damaged_lines_are_skipped(tmp_path: Path) -> None:
    log = tmp_path / "gc.log"
    damaged = "[2026-13-45T99:00:00.000+0000] GC(7) Pause Young (Allocation Failure) 1M->0M(2M) 5.000ms\n"
    log.write_bytes(damaged.encode() + b"\xff\xfe garbage\n" + G1.encode() + b"[2026-12-07T00:27")
    assert [p.ms for p in read_gc_pauses(log)] == [0.754]


def test_rotated_files_are_read_oldest_first_and_an_absent_log_has_no_pauses(tmp_path: Path) -> None:
    log = tmp_path / "gc.log"
    assert read_gc_pauses(log) == []
    (tmp_path / "gc.log.1").write_text(G1)
    log.write_text(SERIAL)
    assert [p.ms for p in read_gc_pauses(log)] == [1.577, 67.031, 0.754]


def test_pauses_between_keeps_those_that_overlap_the_window() -> None:
    pauses = [GcPause(10.0, 100.0, "Pause Young"), GcPause(20.0, 50.0, "Pause Young")]
    assert pauses_between(pauses, 9.95, 10.0) == pauses[:1], "ended inside"
    assert pauses_between(pauses, 9.8, 9.85) == [], "ended before the window"
    assert pauses_between(pauses, 19.96, 30.0) == pauses[1:], "started inside"
    assert pauses_between(pauses, 20.01, 30.0) == []


def test_the_broker_writes_its_gc_log_in_its_state_dir_unless_given_its_own(tmp_path: Path) -> None:
    option = gc_log_option(tmp_path / "gc.log")
    assert option is not None and option.startswith(f'-Xlog:gc:file="{tmp_path / "gc.log"}":time:')
    broker = LocalBroker(tmp_path / "state", jvm_options=FAST_START_JVM_OPTIONS, class_data_sharing=False)
    assert broker.gc_log == tmp_path / "state" / "gc.log"
    command = " ".join(broker._java_command("java", FAKE_DIST, NO_STATE))
    assert str(gc_log_option(broker.gc_log)) in command
    own = LocalBroker(
        tmp_path / "state", jvm_options=["-Xlog:gc*:file=/tmp/mine.log"], class_data_sharing=False
    )
    command = " ".join(own._java_command("java", FAKE_DIST, NO_STATE))
    assert str(own.gc_log) not in command and "-Xlog:gc*:file=/tmp/mine.log" in command


class _FakeDist:
    classpath = "kafka.jar"
    home = Path("/nonexistent")


class _NoState:
    cds_pending: str | None = None


FAKE_DIST: Any = _FakeDist()
NO_STATE: Any = _NoState()


def test_a_state_dir_with_xlog_separators_still_gets_its_log_and_a_quote_none(tmp_path: Path) -> None:
    """-Xlog splits on ':' ',' '=': the path is quoted, and a real JVM writes the file there."""
    odd = tmp_path / "a b:c,d=e"
    odd.mkdir()
    option = gc_log_option(odd / "gc.log")
    assert option is not None
    done = subprocess.run([find_java(), option, "-version"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert " Using " in (odd / "gc.log").read_text()
    assert gc_log_option(tmp_path / 'say "hi"' / "gc.log") is None


def test_a_full_collection_needs_the_jdks_jcmd(tmp_path: Path) -> None:
    (tmp_path / "java").write_text("")  # a JRE: a launcher and no jcmd beside it
    assert request_full_gc(1, str(tmp_path / "java")) is False
