"""A real Kafka broker for test sessions: the environment's, a Docker container, or a local one.

:func:`kafka_for_tests` picks, in order:

1. ``KAFKA_BOOTSTRAP_SERVERS`` when set (it must answer: a set but dead address is an error);
2. an ``apache/kafka`` container through testcontainers, when a Docker engine answers;
3. a :class:`~kvevents.broker.LocalBroker` (Kafka's jars from Maven Central, no Docker).

When none of them gives a broker it raises :class:`KafkaUnavailable`; the pytest fixture turns
that into a failure when Kafka is required (``CI=true`` or ``KVEVENTS_REQUIRE_KAFKA=1``) and a
skip otherwise.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .broker.bootstrap import BOOTSTRAP_ENV
from .broker.config import free_port
from .broker.jars import KAFKA_VERSION
from .broker.probe import metadata_answers, wait_for_metadata

__all__ = [
    "KAFKA_IMAGE",
    "KafkaForTests",
    "KafkaUnavailable",
    "apache_kafka_container_env",
    "kafka_for_tests",
    "kafka_required",
]

log = logging.getLogger(__name__)

KAFKA_IMAGE = f"apache/kafka:{KAFKA_VERSION}"
"""The same Kafka release as the local broker's jars."""
_CONTAINER_PORT = 9092
_TRUE = ("1", "true", "yes", "on")


class KafkaUnavailable(RuntimeError):
    """No broker could be had; the message says what was tried and why each failed."""


@dataclass(frozen=True)
class KafkaForTests:
    """A broker a test session can use."""

    bootstrap_servers: str
    source: str
    """``env``, ``testcontainers`` or ``local``."""
    local_broker: Any = field(default=None, compare=False, repr=False)
    """The :class:`~kvevents.broker.LocalBroker` started for the session (source ``local``)."""

    def revive(self) -> str | None:
        """When the session's local broker has died, start it again at the same address and
        return what happened (with the last lines of its JVM output, log and GC log); None while it runs,
        and for brokers this session did not start."""
        broker = self.local_broker
        if broker is None or broker.status().running:
            return None
        from .broker.process import tail_of

        layout = broker.layout
        evidence = [
            f"--- {path} ---\n{tail_of(path)}" for path in (layout.out_file, layout.log_file, layout.gc_log)
        ]
        status = broker.start()
        moved = (
            ""
            if status.bootstrap_servers == self.bootstrap_servers
            else f" (now at {status.bootstrap_servers})"
        )
        return (
            f"the session's Kafka broker at {self.bootstrap_servers} had died; restarted it{moved}.\n"
            + "\n".join(evidence)
        )


def kafka_required(environ: dict[str, str] | None = None) -> bool:
    """Whether a missing broker must fail the run: ``CI=true`` or ``KVEVENTS_REQUIRE_KAFKA=1``."""
    env = os.environ if environ is None else environ
    return env.get("CI", "").lower() in _TRUE or env.get("KVEVENTS_REQUIRE_KAFKA", "").lower() in _TRUE


def apache_kafka_container_env(advertised_host: str, host_port: int) -> dict[str, str]:
    """Environment for the ``apache/kafka`` image: one KRaft node whose client listener is
    advertised at ``advertised_host:host_port`` (the port the container's 9092 is bound to)."""
    return {
        "KAFKA_NODE_ID": "1",
        "KAFKA_PROCESS_ROLES": "broker,controller",
        "KAFKA_LISTENERS": f"PLAINTEXT://:{_CONTAINER_PORT},CONTROLLER://:9093",
        "KAFKA_ADVERTISED_LISTENERS": f"PLAINTEXT://{advertised_host}:{host_port}",
        "KAFKA_CONTROLLER_LISTENER_NAMES": "CONTROLLER",
        "KAFKA_LISTENER_SECURITY_PROTOCOL_MAP": "CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT",
        "KAFKA_CONTROLLER_QUORUM_VOTERS": "1@localhost:9093",
        "KAFKA_OFFSETS_TOPIC_REPLICATION_FACTOR": "1",
        "KAFKA_OFFSETS_TOPIC_NUM_PARTITIONS": "1",
        "KAFKA_TRANSACTION_STATE_LOG_REPLICATION_FACTOR": "1",
        "KAFKA_TRANSACTION_STATE_LOG_MIN_ISR": "1",
        "KAFKA_SHARE_COORDINATOR_STATE_TOPIC_REPLICATION_FACTOR": "1",
        "KAFKA_SHARE_COORDINATOR_STATE_TOPIC_MIN_ISR": "1",
        "KAFKA_GROUP_INITIAL_REBALANCE_DELAY_MS": "0",
    }


@contextmanager
def _container(image: str, start_timeout: float) -> Iterator[KafkaForTests]:
    """An ``apache/kafka`` container; raises ``_NoDocker`` at once when no engine answers."""
    try:
        from docker.errors import DockerException
        from testcontainers.core.container import DockerContainer
    except ImportError as exc:
        raise _NoDocker(f"testcontainers is not installed ({exc})") from exc
    try:
        container: Any = DockerContainer(image)
        advertised_host = container.get_docker_client().host()
    except DockerException as exc:
        raise _NoDocker(f"no Docker engine ({exc})") from exc
    host_port = free_port("0.0.0.0")
    container.with_bind_ports(_CONTAINER_PORT, host_port)
    container.with_envs(**apache_kafka_container_env(advertised_host, host_port))
    try:
        container.start()
    except DockerException as exc:
        raise _NoDocker(f"the Docker engine could not start {image} ({exc})") from exc
    try:
        bootstrap = f"{advertised_host}:{host_port}"
        wait_for_metadata(bootstrap, start_timeout)
        yield KafkaForTests(bootstrap, "testcontainers")
    finally:
        container.stop()


class _NoDocker(Exception):
    pass


@contextmanager
def kafka_for_tests(
    state_dir: Path,
    use_docker: bool = True,
    start_timeout: float = 180.0,
    probe_timeout: float = 10.0,
) -> Iterator[KafkaForTests]:
    """Yield a running broker for a test session and stop what was started for it afterwards.

    ``state_dir`` holds the local broker's files when one is started; ``probe_timeout`` is how
    long an address from the environment has to answer.
    """
    tried: list[str] = []
    from_env = os.environ.get(BOOTSTRAP_ENV, "").strip()
    if from_env:
        if not metadata_answers(from_env, timeout=probe_timeout):
            raise KafkaUnavailable(f"{BOOTSTRAP_ENV}={from_env} is set but no broker answers there")
        yield KafkaForTests(from_env, "env")
        return
    tried.append(f"{BOOTSTRAP_ENV} is not set")

    if use_docker:
        try:
            with _container(KAFKA_IMAGE, start_timeout) as kafka:
                yield kafka
                return
        except _NoDocker as exc:
            tried.append(f"testcontainers: {exc}")
            log.info("no Docker for Kafka: %s; starting a local broker", exc)

    from .broker.jars import FetchError
    from .broker.process import BrokerAlreadyRunning, BrokerError, LocalBroker

    broker = LocalBroker(state_dir, start_timeout=start_timeout, stop_with_parent=True)
    try:
        try:
            status = broker.start()
        except BrokerAlreadyRunning:  # left over by an interrupted session: start afresh
            broker.stop()
            status = broker.start()
    except (BrokerError, FetchError) as exc:
        tried.append(f"local broker: {exc}")
        raise KafkaUnavailable("no Kafka broker for the tests:\n- " + "\n- ".join(tried)) from exc
    try:
        assert status.bootstrap_servers is not None
        yield KafkaForTests(status.bootstrap_servers, "local", broker)
    finally:
        broker.stop()
