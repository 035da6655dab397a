"""The CLI failing well, driven as a user would (the installed ``kvevents`` in a subprocess):
a closed port is one line within seconds and exit 1 (librdkafka's log only with -v), an
unknown topic and a refused -X/-F setting one line naming it; -F FILE works on every Kafka
command."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from kvevents.consumer.topics import TopicSpec, create_topic

pytestmark = pytest.mark.kafka

KVEVENTS = str(Path(sys.executable).with_name("kvevents"))


def _closed_port() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"127.0.0.1:{port}"  # nothing listens there once the socket is closed


def _run(*args: str, timeout: float = 60) -> tuple[int, str, str, float]:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("KAFKA_BOOTSTRAP_SERVERS", "KVEVENTS_SCHEMA_REGISTRY_URL")
    }
    started = time.monotonic()
    done = subprocess.run([KVEVENTS, *args], capture_output=True, text=True, timeout=timeout, env=env)
    return done.returncode, done.stdout, done.stderr, time.monotonic() - started


@pytest.mark.parametrize(
    "argv",
    [
        ["tail", "--no-follow"],
        ["stats"],
        ["index"],
        ["route", "--synthetic", "1"],
        ["simulate", "--requests", "1", "--no-realtime"],
        ["topic", "describe", "some-topic"],
        ["export", "dynamo", "--no-follow"],
    ],
    ids=lambda argv: "-".join(argv[:2]),
)
def test_an_unreachable_broker_is_one_line_within_seconds(argv: list[str]) -> None:
    code, out, err, seconds = _run(*argv, "-b", _closed_port())
    assert code == 1 and out == ""
    assert (
        err.count("\n") == 1 and "no Kafka broker answers at 127.0.0.1:" in err and "cannot connect" in err
    ), err
    assert seconds < 15


def test_librdkafka_logs_show_with_verbose() -> None:
    code, _, err, _ = _run("tail", "--no-follow", "-b", _closed_port(), "-v")
    assert code == 1 and "Connection refused" in err and err.count("\n") > 1


def test_an_unknown_topic_is_one_line(kafka_bootstrap: str) -> None:
    topic = f"missing-{uuid.uuid4().hex[:8]}"
    for argv in (["tail", "--no-follow"], ["index"], ["stats"]):
        code, _, err, _ = _run(*argv, "-b", kafka_bootstrap, "-t", topic)
        assert code == 1 and err.strip() == (
            f"kvevents {argv[0]}: topic {topic!r} does not exist at {kafka_bootstrap} "
            f"(create it: kvevents topic create {topic})"
        )


def test_bad_settings_are_one_line_naming_them(kafka_bootstrap: str, tmp_path: Path) -> None:
    code, _, err, _ = _run("tail", "--no-follow", "-b", kafka_bootstrap, "-X", "fetch.max.bytes=lots")
    assert code == 1 and err.count("\n") == 1 and '"fetch.max.bytes"' in err and "-X or -F" in err
    props = tmp_path / "bad.properties"
    props.write_text("no.such.property=1\n")
    code, _, err, _ = _run("index", "-b", kafka_bootstrap, "-F", str(props))
    assert code == 1 and err.count("\n") == 1 and '"no.such.property"' in err
    props.write_text("just words\n")
    code, _, err, _ = _run("tail", "-b", kafka_bootstrap, "-F", str(props))
    assert code == 2 and "bad.properties:1: expected KEY=VALUE" in err


@pytest.mark.slow
def test_a_properties_file_configures_the_clients(kafka_bootstrap: str, tmp_path: Path) -> None:
    topic = f"props-{uuid.uuid4().hex[:8]}"
    props = tmp_path / "client.properties"
    props.write_text(
        f"# as for kcat -F\nbootstrap.servers={kafka_bootstrap}\nclient.id=kvevents-props-test\n"
    )
    code, out, err, _ = _run("topic", "create", topic, "-b", kafka_bootstrap, "-F", str(props))
    assert code == 0, err
    code, out, err, _ = _run("simulate", "-b", kafka_bootstrap, "-t", topic, "-F", str(props),
                             "--requests", "5", "--no-realtime", "-q")  # fmt: skip
    assert code == 0, err
    code, out, err, _ = _run("tail", "-b", kafka_bootstrap, "-t", topic, "-F", str(props),
                             "--from-beginning", "--no-follow", "--no-batches")  # fmt: skip
    assert code == 0 and out.count("\n") > 0 and "0 malformed" in err
    assert " parent=" in out and " hashes=0x" in out


def test_the_topic_command_reads_an_existing_topic_with_x(kafka_bootstrap: str) -> None:
    topic = f"topic-x-{uuid.uuid4().hex[:8]}"
    create_topic(kafka_bootstrap, TopicSpec(topic, partitions=2))
    code, out, err, _ = _run("topic", "describe", topic, "-b", kafka_bootstrap, "-X", "client.id=kv-x")
    assert code == 0 and "2 partition(s)" in out, err
