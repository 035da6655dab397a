"""Choosing the test session's broker, without starting one: the fall-through from the
environment to Docker to the local broker, and CI's "no broker is a failure" rule."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from kvevents.broker.config import free_port
from kvevents.testing import (
    KAFKA_IMAGE,
    KafkaUnavailable,
    apache_kafka_container_env,
    kafka_for_tests,
    kafka_required,
)

REPO = Path(__file__).resolve().parents[3]


@pytest.mark.parametrize(
    ("environ", "required"),
    [
        ({}, False),
        ({"CI": "true"}, True),
        ({"CI": "1"}, True),
        ({"CI": "false"}, False),
        ({"KVEVENTS_REQUIRE_KAFKA": "1"}, True),
        ({"KVEVENTS_REQUIRE_KAFKA": "0"}, False),
    ],
)
def test_kafka_is_required_in_ci(environ: dict[str, str], required: bool) -> None:
    assert kafka_required(environ) is required


def test_container_env_is_a_single_kraft_node_advertised_on_the_host_port() -> None:
    env = apache_kafka_container_env("docker-host", 41234)
    assert env["KAFKA_PROCESS_ROLES"] == "broker,controller"
    assert env["KAFKA_ADVERTISED_LISTENERS"] == "PLAINTEXT://docker-host:41234"
    assert env["KAFKA_CONTROLLER_QUORUM_VOTERS"] == "1@localhost:9093"
    assert env["KAFKA_OFFSETS_TOPIC_REPLICATION_FACTOR"] == "1"
    assert env["KAFKA_TRANSACTION_STATE_LOG_MIN_ISR"] == "1"


def test_compose_runs_the_same_kafka_with_a_healthcheck_and_a_host_listener() -> None:
    compose = yaml.safe_load((REPO / "compose.yaml").read_text())
    kafka = compose["services"]["kafka"]
    assert kafka["image"] == KAFKA_IMAGE
    assert "${KVEVENTS_BIND_ADDRESS:-127.0.0.1}:9092:9092" in kafka["ports"]  # loopback unless told otherwise
    env = kafka["environment"]
    assert env["KAFKA_PROCESS_ROLES"] == "broker,controller"
    assert "HOST://localhost:9092" in env["KAFKA_ADVERTISED_LISTENERS"]
    listeners = {item.split("://")[0] for item in env["KAFKA_LISTENERS"].split(",")}
    mapped = {item.split(":")[0] for item in env["KAFKA_LISTENER_SECURITY_PROTOCOL_MAP"].split(",")}
    assert listeners == mapped
    assert "kafka-broker-api-versions.sh --bootstrap-server localhost:9092" in " ".join(
        kafka["healthcheck"]["test"]
    )


def test_a_set_but_dead_bootstrap_address_is_an_error(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    dead = f"127.0.0.1:{free_port()}"
    monkeypatch.setenv("KAFKA_BOOTSTRAP_SERVERS", dead)
    expected = f"KAFKA_BOOTSTRAP_SERVERS={re.escape(dead)} is set but no broker answers"
    with pytest.raises(KafkaUnavailable, match=expected), kafka_for_tests(tmp_path, probe_timeout=1.0):
        pass


def without_any_broker(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> dict[str, str]:
    """No KAFKA_BOOTSTRAP_SERVERS, a Docker socket that does not exist, and no java on PATH."""
    empty = tmp_path / "empty-path"
    empty.mkdir(exist_ok=True)
    changes = {
        "DOCKER_HOST": f"unix://{tmp_path}/no-docker.sock",
        "PATH": str(empty),
        "KVEVENTS_CACHE_DIR": str(tmp_path / "cache"),
    }
    monkeypatch.delenv("KAFKA_BOOTSTRAP_SERVERS", raising=False)
    monkeypatch.delenv("JAVA_HOME", raising=False)
    monkeypatch.delenv("KVEVENTS_TEST_BROKER_DIR", raising=False)
    for key, value in changes.items():
        monkeypatch.setenv(key, value)
    return changes


def test_without_docker_or_java_every_attempt_is_reported(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    without_any_broker(monkeypatch, tmp_path)
    with pytest.raises(KafkaUnavailable) as caught, kafka_for_tests(tmp_path / "broker"):
        pass
    message = str(caught.value)
    assert "KAFKA_BOOTSTRAP_SERVERS is not set" in message
    assert "testcontainers: no Docker engine" in message
    assert "local broker: no 'java' on PATH" in message


INNER_TEST = """
def test_uses_kafka(kafka_bootstrap):
    assert kafka_bootstrap
"""


def run_inner_session(tmp_path: Path, environ: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """Run pytest on a one-test project that uses this repository's conftest.py."""
    project = tmp_path / "inner"
    project.mkdir()
    shutil.copy(REPO / "tests" / "conftest.py", project / "conftest.py")
    (project / "test_inner.py").write_text(INNER_TEST)
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs", str(project)],
        capture_output=True, text=True, timeout=120, env=environ, cwd=project,
    )  # fmt: skip


def test_ci_fails_the_tests_when_no_broker_can_be_had(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    without_any_broker(monkeypatch, tmp_path)
    monkeypatch.setenv("CI", "true")
    result = run_inner_session(tmp_path, dict(os.environ))
    assert result.returncode == 1, result.stdout + result.stderr
    assert "1 error" in result.stdout and "skipped" not in result.stdout
    assert "Kafka is required here" in result.stdout


def test_outside_ci_the_tests_are_skipped_when_no_broker_can_be_had(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    without_any_broker(monkeypatch, tmp_path)
    monkeypatch.delenv("CI", raising=False)
    monkeypatch.delenv("KVEVENTS_REQUIRE_KAFKA", raising=False)
    result = run_inner_session(tmp_path, dict(os.environ))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "1 skipped" in result.stdout and "no Kafka broker" in result.stdout
