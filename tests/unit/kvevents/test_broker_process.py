"""Pid handling of LocalBroker with stand-in processes: status, stale pids, SIGTERM then SIGKILL.

A stand-in is a Python process whose command line carries ``kafka.Kafka`` and the state
directory's ``server.properties``, which is how LocalBroker recognises its broker.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvevents.broker import BrokerAlreadyRunning, BrokerError, LocalBroker, find_java
from kvevents.broker.config import BrokerLayout, BrokerState

OBEYS_SIGTERM = "import time; time.sleep(60)"
IGNORES_SIGTERM = (
    "import signal, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
    "print('ready', flush=True); time.sleep(60)"
)


@pytest.fixture
def spawned() -> Iterator[list[subprocess.Popen[bytes]]]:
    processes: list[subprocess.Popen[bytes]] = []
    yield processes
    for process in processes:
        if process.poll() is None:
            process.kill()
        process.wait()


def stand_in(state_dir: Path, code: str, spawned: list[subprocess.Popen[bytes]]) -> subprocess.Popen[bytes]:
    layout = BrokerLayout(state_dir)
    process = subprocess.Popen(
        [sys.executable, "-c", code, "kafka.Kafka", str(layout.server_properties)], stdout=subprocess.PIPE
    )
    spawned.append(process)
    layout.write_pid(process.pid)
    BrokerState("127.0.0.1", 1111, 1112, "cid", "4.1.1").save(layout)
    return process


def dead_pid() -> int:
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


def test_status_of_an_empty_directory_is_stopped(tmp_path: Path) -> None:
    status = LocalBroker(tmp_path / "never-started").status()
    assert not status.running
    assert status.pid is None and status.bootstrap_servers is None
    assert "stopped" in status.describe()


def test_stop_without_a_broker_does_nothing(tmp_path: Path) -> None:
    result = LocalBroker(tmp_path / "never-started").stop()
    assert not result.was_running and not result.killed
    assert result.describe() == "no broker was running"


def test_a_dead_pid_is_reported_stale_and_cleaned_by_stop(tmp_path: Path) -> None:
    layout = BrokerLayout(tmp_path)
    layout.write_pid(dead_pid())
    broker = LocalBroker(tmp_path)
    status = broker.status()
    assert not status.running
    assert status.note is not None and "stale" in status.note
    assert not broker.stop().was_running
    assert not layout.pid_file.exists()


def test_a_reused_pid_of_another_program_is_not_taken_for_the_broker(
    tmp_path: Path, spawned: list[subprocess.Popen[bytes]]
) -> None:
    other = subprocess.Popen([sys.executable, "-c", OBEYS_SIGTERM])
    spawned.append(other)
    BrokerLayout(tmp_path).write_pid(other.pid)
    broker = LocalBroker(tmp_path)
    assert not broker.status().running
    assert not broker.stop(timeout=1).was_running
    assert other.poll() is None, "stop() must never signal a process that is not this broker"


def test_status_reports_a_running_broker_from_its_pid_file(
    tmp_path: Path, spawned: list[subprocess.Popen[bytes]]
) -> None:
    process = stand_in(tmp_path, OBEYS_SIGTERM, spawned)
    status = LocalBroker(tmp_path).status()
    assert status.running and status.pid == process.pid
    assert status.bootstrap_servers == "127.0.0.1:1111"
    assert LocalBroker(tmp_path).bootstrap_servers == "127.0.0.1:1111"


def test_stop_sends_sigterm_and_waits(tmp_path: Path, spawned: list[subprocess.Popen[bytes]]) -> None:
    process = stand_in(tmp_path, OBEYS_SIGTERM, spawned)
    result = LocalBroker(tmp_path).stop(timeout=10)
    assert result.was_running and not result.killed and result.pid == process.pid
    assert process.wait(5) == -15
    assert "stopped cleanly" in result.describe()
    assert not BrokerLayout(tmp_path).pid_file.exists()


def test_stop_kills_a_broker_that_ignores_sigterm_and_says_so(
    tmp_path: Path, spawned: list[subprocess.Popen[bytes]]
) -> None:
    process = stand_in(tmp_path, IGNORES_SIGTERM, spawned)
    assert process.stdout is not None and process.stdout.readline() == b"ready\n"
    started = time.monotonic()
    result = LocalBroker(tmp_path).stop(timeout=0.5)
    assert result.killed
    assert process.wait(5) == -9
    assert time.monotonic() - started >= 0.5
    assert "SIGKILL" in result.describe()


def test_start_refuses_when_a_broker_runs_in_the_same_directory(
    tmp_path: Path, spawned: list[subprocess.Popen[bytes]]
) -> None:
    process = stand_in(tmp_path, OBEYS_SIGTERM, spawned)
    with pytest.raises(BrokerAlreadyRunning) as caught:
        LocalBroker(tmp_path).start()
    assert caught.value.status.pid == process.pid
    assert process.poll() is None


def test_bootstrap_servers_of_a_stopped_broker_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(BrokerError, match="no broker is running"):
        _ = LocalBroker(tmp_path).bootstrap_servers


def test_missing_java_is_a_clear_error(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("JAVA_HOME", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(BrokerError, match="Java 17"):
        find_java()
    with pytest.raises(BrokerError, match="java"):
        LocalBroker(tmp_path / "b").start()


def test_jvm_options_come_from_the_environment_when_not_given(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVEVENTS_BROKER_JVM_OPTS", "-XX:+UseG1GC -Dx='a b'")
    monkeypatch.setenv("KVEVENTS_BROKER_HEAP", "1g")
    broker = LocalBroker("/nonexistent")
    assert broker.jvm_options == ("-XX:+UseG1GC", "-Dx=a b")
    assert broker.heap == "1g"
    assert LocalBroker("/nonexistent", jvm_options=["-Xint"]).jvm_options == ("-Xint",)


def test_pid_file_is_written_atomically(tmp_path: Path) -> None:
    layout = BrokerLayout(tmp_path)
    layout.write_pid(os.getpid())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["broker.pid"]


def test_a_clean_stop_adopts_the_class_data_archive_the_jvm_dumped(
    tmp_path: Path, spawned: list[subprocess.Popen[bytes]]
) -> None:
    stand_in(tmp_path, OBEYS_SIGTERM, spawned)
    layout = BrokerLayout(tmp_path)
    pending = tmp_path / "cds" / "broker-abc.123-456.tmp"
    pending.parent.mkdir()
    pending.write_bytes(b"archive")  # what -XX:ArchiveClassesAtExit leaves behind
    state = BrokerState.load(layout)
    assert state is not None
    state.cds_pending = str(pending)
    state.save(layout)
    assert LocalBroker(tmp_path).stop(timeout=10).was_running
    assert (tmp_path / "cds" / "broker-abc.jsa").read_bytes() == b"archive"
    assert not pending.exists()
    assert BrokerState.load(layout).cds_pending is None  # type: ignore[union-attr]


def test_an_archive_left_by_a_dead_broker_is_dropped(tmp_path: Path) -> None:
    layout = BrokerLayout(tmp_path)
    pending = tmp_path / "broker-abc.1-2.tmp"
    pending.write_bytes(b"maybe truncated")
    BrokerState("127.0.0.1", 1, 2, "cid", "4.1.1", cds_pending=str(pending)).save(layout)
    layout.write_pid(dead_pid())
    assert not LocalBroker(tmp_path).stop().was_running
    assert not pending.exists() and not (tmp_path / "broker-abc.jsa").exists()
