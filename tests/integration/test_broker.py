"""The local Kafka broker for real: a JVM on free ports in a temporary directory."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from confluent_kafka import KafkaError, Producer
from kvevents.consumer.topics import TopicMismatch, TopicSpec, create_topic, describe_topic

from kvevents._spawn import pid_alive
from kvevents.broker.bootstrap import BOOTSTRAP_ENV
from kvevents.broker.config import BrokerLayout, BrokerPorts, BrokerState, free_port
from kvevents.broker.gclog import read_gc_pauses, request_full_gc
from kvevents.broker.probe import metadata_answers
from kvevents.broker.process import BrokerStartError, LocalBroker, find_java
from kvevents.cli import main
from kvevents.testing import kafka_for_tests

pytestmark = [pytest.mark.kafka, pytest.mark.slow]


def produce(bootstrap: str, topic: str, values: list[bytes], **config: object) -> list[str | None]:
    """Produce and flush; per message, in the order given, its delivery error's name or None."""
    producer = Producer({"bootstrap.servers": bootstrap, "enable.idempotence": True, **config})
    errors: list[str | None] = [None] * len(values)

    def delivered(index: int) -> Callable[[KafkaError | None, object], None]:
        def record(err: KafkaError | None, _msg: object) -> None:
            errors[index] = None if err is None else err.name()

        return record

    for index, value in enumerate(values):
        producer.produce(topic, value=value, on_delivery=delivered(index))
    assert producer.flush(30) == 0
    return errors


def assert_gc_pauses_are_logged(broker: LocalBroker, pid: int) -> None:
    """The broker's GC log names its collector and records a collection asked of it with jcmd
    (beside the broker's java: a JDK's, as CI's Maven needs)."""
    assert " Using " in broker.gc_log.read_text().splitlines()[0], "the collector is named"
    before = len(read_gc_pauses(broker.gc_log))
    assert request_full_gc(pid, find_java())
    pauses = read_gc_pauses(broker.gc_log)
    assert len(pauses) > before and pauses[-1].kind == "Pause Full"
    assert abs(pauses[-1].end_s - time.time()) < 60, "wall-clock times"


def test_a_dead_session_broker_is_revived_at_the_same_address(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(BOOTSTRAP_ENV, raising=False)
    with kafka_for_tests(tmp_path / "kafka", use_docker=False) as kafka:
        assert kafka.source == "local" and kafka.revive() is None, "alive: nothing to do"
        broker = kafka.local_broker
        pid = broker.status().pid
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while pid_alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        note = kafka.revive()
        assert note is not None and f"at {kafka.bootstrap_servers} had died" in note
        assert "now at" not in note, "the same address"
        assert str(broker.layout.log_file) in note, "the evidence: the broker's log"
        assert broker.status().pid not in (None, pid)
        assert metadata_answers(kafka.bootstrap_servers, 10)
    assert not broker.status().running, "the session's end still stops it"


def test_start_status_stop_and_a_fast_restart_that_keeps_the_data(tmp_path: Path) -> None:
    broker = LocalBroker(tmp_path / "kafka", stop_with_parent=True)
    layout = BrokerLayout(tmp_path / "kafka")
    try:
        status = broker.start()
        assert status.running and status.answers
        assert status.pid is not None and pid_alive(status.pid)
        assert layout.read_pid() == status.pid
        bootstrap = broker.bootstrap_servers
        assert bootstrap == status.bootstrap_servers and bootstrap.startswith("127.0.0.1:")
        assert metadata_answers(bootstrap)
        assert broker.status(probe=True).answers is True
        assert layout.log_file.stat().st_size > 0, "the broker logs to its log file"
        cluster_id = BrokerState.load(layout).cluster_id  # type: ignore[union-attr]
        formatted_at = (layout.data_dir / "meta.properties").stat().st_mtime_ns

        create_topic(bootstrap, TopicSpec("kept", partitions=2))
        assert produce(bootstrap, "kept", [b"a", b"b", b"c"]) == [None, None, None]
        assert_gc_pauses_are_logged(broker, status.pid)

        stopped = broker.stop()
        assert stopped.was_running and not stopped.killed and stopped.pid == status.pid
        assert not pid_alive(status.pid)
        assert not broker.status().running and layout.read_pid() is None

        restarted_at = time.monotonic()
        again = broker.start()
        restart_seconds = time.monotonic() - restarted_at
        print(f"restart took {restart_seconds:.2f} s, phases {broker.last_start_phases}")
        assert again.bootstrap_servers == bootstrap, "a restart keeps its (still free) ports"
        assert BrokerState.load(layout).cluster_id == cluster_id  # type: ignore[union-attr]
        assert (layout.data_dir / "meta.properties").stat().st_mtime_ns == formatted_at, "no reformat"
        assert describe_topic(bootstrap, "kept").messages == 3, "data survives a restart"
        # Generous: a restart is ~1-2 s here; this only catches a restart that re-downloads or hangs.
        assert restart_seconds < 30
    finally:
        broker.stop()
    assert not broker.status().running


def test_the_cli_starts_reports_and_stops_a_broker(tmp_path: Path) -> None:
    state = tmp_path / "cli-kafka"
    env = {**os.environ, "KVEVENTS_BROKER_DIR": str(state)}
    env.pop("KAFKA_BOOTSTRAP_SERVERS", None)
    cli = [sys.executable, "-m", "kvevents.cli"]

    def run(*argv: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*cli, *argv], capture_output=True, text=True, env=env, timeout=180)

    started = run("broker", "start")
    try:
        assert started.returncode == 0, started.stderr
        assert "Kafka broker running: bootstrap 127.0.0.1:" in started.stdout
        again = run("broker", "start")
        assert again.returncode == 0 and "already running" in again.stdout

        status = run("broker", "status", "--json")
        assert status.returncode == 0, status.stderr
        report = json.loads(status.stdout)
        assert report["running"] and report["answers"] and report["state_dir"] == str(state)
        assert report["gc_log"] == str(state / "gc.log")
        assert report["gc_pauses_last_10_min"] >= 0
        text = run("broker", "status")
        assert f"gc:    {state / 'gc.log'} (" in text.stdout and "in the last 10 minutes" in text.stdout

        # Topic commands find the running broker without KAFKA_BOOTSTRAP_SERVERS.
        created = run("topic", "create", "from-cli", "--partitions", "2", "--retention-ms", "60000")
        assert created.returncode == 0, created.stderr
        described = run("topic", "describe", "from-cli", "--json")
        assert described.returncode == 0, described.stderr
        topic = json.loads(described.stdout)
        assert len(topic["partitions"]) == 2 and topic["configs"]["retention.ms"] == "60000"
    finally:
        stopped = run("broker", "stop")
    assert stopped.returncode == 0 and "stopped cleanly" in stopped.stdout, stopped.stdout + stopped.stderr
    assert not pid_alive(report["pid"])
    assert run("broker", "status").returncode == 3


def test_a_taken_port_fails_the_start_with_the_log_quoted(tmp_path: Path) -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        broker = LocalBroker(
            tmp_path / "kafka",
            port=port,
            controller_port=free_port(exclude=frozenset({port})),
            stop_with_parent=True,
        )
        with pytest.raises(BrokerStartError) as caught:
            broker.start()
    message = str(caught.value)
    assert "failed to start" in message
    assert "Address already in use" in message
    assert not broker.status().running
    assert BrokerLayout(tmp_path / "kafka").read_pid() is None


def test_a_free_port_taken_before_the_jvm_binds_it_is_retried_with_others(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import kvevents.broker.process as broker_module

    real_choose = broker_module.choose_ports
    calls: list[BrokerPorts] = []
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        taken = held.getsockname()[1]

        def choose(*args: object, **kwargs: object) -> BrokerPorts:
            ports = (
                real_choose(*args, **kwargs)
                if calls
                else BrokerPorts(taken, free_port(exclude=frozenset({taken})))
            )
            calls.append(ports)
            return ports

        monkeypatch.setattr(broker_module, "choose_ports", choose)
        with LocalBroker(tmp_path / "kafka", stop_with_parent=True) as broker:
            assert len(calls) == 2 and calls[0].client == taken
            assert broker.bootstrap_servers == f"127.0.0.1:{calls[1].client}"
            assert metadata_answers(broker.bootstrap_servers)


def test_a_bad_setting_fails_the_start_quoting_the_broker_log(tmp_path: Path) -> None:
    broker = LocalBroker(
        tmp_path / "kafka", extra_properties={"log.retention.hours": "soon"}, stop_with_parent=True
    )
    with pytest.raises(BrokerStartError) as caught:
        broker.start()
    assert "log.retention.hours" in str(caught.value)
    assert not broker.status().running


# -- topics, on the session's broker -------------------------------------------------------------


def test_topic_settings_are_applied_and_enforced(kafka_topic_factory, kafka_bootstrap: str) -> None:
    limit = 100_000
    name = kafka_topic_factory(partitions=3, retention_ms=3_600_000, max_message_bytes=limit)
    topic = describe_topic(kafka_bootstrap, name)
    assert [p.partition for p in topic.partitions] == [0, 1, 2]
    assert all(p.leader is not None and p.isr for p in topic.partitions)
    assert topic.retention_ms == 3_600_000 and topic.max_message_bytes == limit
    assert topic.overrides == {"retention.ms": "3600000", "max.message.bytes": str(limit)}
    assert topic.messages == 0

    assert produce(kafka_bootstrap, name, [b"x" * 100] * 5) == [None] * 5
    # Under the producer's own 1 MB limit, over the topic's: the broker refuses it.
    assert produce(kafka_bootstrap, name, [b"y" * (2 * limit)]) == ["MSG_SIZE_TOO_LARGE"]
    after = describe_topic(kafka_bootstrap, name)
    assert after.messages == 5
    assert sum(p.high_watermark for p in after.partitions) == 5


def test_create_is_idempotent_and_names_differences(
    kafka_bootstrap: str, request: pytest.FixtureRequest
) -> None:
    spec = TopicSpec(
        f"idem-{os.getpid()}-{time.time_ns()}", partitions=2, cleanup_policy="compact", retention_ms=-1
    )
    assert create_topic(kafka_bootstrap, spec) is True
    assert create_topic(kafka_bootstrap, spec) is False
    topic = describe_topic(kafka_bootstrap, spec.name)
    assert topic.cleanup_policy == "compact" and topic.retention_ms == -1
    with pytest.raises(
        TopicMismatch, match=r"partitions: wanted 4, topic has 2; cleanup\.policy: wanted delete"
    ):
        create_topic(kafka_bootstrap, TopicSpec(spec.name, partitions=4, cleanup_policy="delete"))


def test_topic_cli_honours_kafka_bootstrap_servers(
    kafka_bootstrap: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    monkeypatch.setenv("KAFKA_BOOTSTRAP_SERVERS", kafka_bootstrap)
    monkeypatch.setenv("KVEVENTS_BROKER_DIR", str(tmp_path / "no-local-broker"))
    name = f"cli-{time.time_ns()}"
    argv = ["topic", "create", name, "-p", "2", "--max-message-bytes", "4194304", "-c", "segment.ms=600000"]
    assert main(argv) == 0
    assert "created" in capsys.readouterr().out
    assert main(argv) == 0
    assert "already exists with these settings" in capsys.readouterr().out
    assert main(["topic", "describe", name]) == 0
    out = capsys.readouterr().out
    assert "2 partition(s), 0 message(s)" in out and "max.message.bytes=4194304" in out
    assert "segment.ms=600000" in out
    assert main(["topic", "describe", "no-such-topic-here"]) == 1
    assert "does not exist" in capsys.readouterr().err
