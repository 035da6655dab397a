"""kvevents' pytest plugin (entry point ``pytest11``): a real Kafka broker and realistic event
streams for the integration tests of routers and other consumers.

Fixtures (any test in an environment where kvevents is installed can ask for them):

- ``kafka`` / ``kafka_bootstrap`` (session): ``KAFKA_BOOTSTRAP_SERVERS`` if set, else an
  ``apache/kafka`` container through testcontainers when Docker answers, else a local broker
  from Maven Central's jars (``kvevents.testing``). Without one the test fails when ``CI=true``
  or ``KVEVENTS_REQUIRE_KAFKA=1``, and is skipped otherwise.
- ``kafka_topic`` (a fresh one-partition topic per test), ``kafka_topic_factory(**settings)``.
- ``kvevents_stream(**options)``: simulated engines' KV-cache events produced to a fresh topic,
  returned with every worker's ground-truth cache (:class:`kvevents.event_streams.ProducedStream`).
- ``schema_registry_url`` (session): a real Confluent-compatible schema registry
  (``$KVEVENTS_TEST_SCHEMA_REGISTRY_URL``, else Apicurio started by ``kvevents.registry``);
  no registry is a failure.

Tests using the Kafka fixtures get the ``kafka`` marker (``pytest -m 'not kafka'`` skips them).
A local session broker that dies during a test fails that test (teardown error, with the
broker's last log lines) and is started again at the same address for the tests after it.
"""

from __future__ import annotations

import os
import re
import uuid
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest

KAFKA_FIXTURES = frozenset(
    {"kafka", "kafka_bootstrap", "kafka_topic", "kafka_topic_factory", "kvevents_stream"}
)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "kafka: needs a real Kafka broker (local, testcontainers or env)")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if KAFKA_FIXTURES.intersection(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.kafka)


@pytest.fixture(scope="session")
def kafka(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """The session's Kafka broker (a ``kvevents.testing.KafkaForTests``); the local broker's
    state goes to ``$KVEVENTS_TEST_BROKER_DIR`` or a temporary directory."""
    from kvevents.testing import KafkaUnavailable, kafka_for_tests, kafka_required

    explicit_dir = os.environ.get("KVEVENTS_TEST_BROKER_DIR")
    state_dir = Path(explicit_dir) if explicit_dir else tmp_path_factory.mktemp("kafka-broker")
    with ExitStack() as stack:
        try:
            found = stack.enter_context(kafka_for_tests(state_dir))
        except KafkaUnavailable as exc:
            if kafka_required():
                pytest.fail(
                    f"Kafka is required here (CI=true or KVEVENTS_REQUIRE_KAFKA=1): {exc}", pytrace=False
                )
            pytest.skip(f"no Kafka broker: {exc}")
        yield found


@pytest.fixture(autouse=True)
def _kafka_stays_up(request: pytest.FixtureRequest) -> Iterator[None]:
    """After each test that used the session's local broker: if the broker died meanwhile, the
    test errors (naming it, with the broker's last log lines) and the broker is started again
    at the same address, so that one death is one error, not every later Kafka test's."""
    yield
    if "kafka" not in request.fixturenames:
        return
    try:
        kafka = request.getfixturevalue("kafka")
    except (pytest.fail.Exception, pytest.skip.Exception):
        return  # no broker for this session: its tests already say so
    note = kafka.revive()
    if note is not None:
        pytest.fail(f"during {request.node.nodeid}: {note}", pytrace=False)


@pytest.fixture(scope="session")
def kafka_bootstrap(kafka: Any) -> str:
    """``host:port`` of the session's Kafka broker."""
    return str(kafka.bootstrap_servers)


@pytest.fixture
def kafka_topic_factory(kafka_bootstrap: str, request: pytest.FixtureRequest) -> Callable[..., str]:
    """Make a topic with a name unique to this test: ``factory(partitions=3, retention_ms=...)``
    (the settings of ``kvevents.consumer.topics.TopicSpec``)."""
    from kvevents.consumer.topics import TopicSpec, create_topic

    stem = re.sub(r"[^a-zA-Z0-9._-]+", "-", request.node.name)[:120].strip("-") or "test"

    def make(**settings: Any) -> str:
        name = f"{stem}-{uuid.uuid4().hex[:10]}"
        create_topic(kafka_bootstrap, TopicSpec(name, **settings))
        return name

    return make


@pytest.fixture
def kafka_topic(kafka_topic_factory: Callable[..., str]) -> str:
    """A fresh single-partition topic for this test."""
    return kafka_topic_factory()


@pytest.fixture
def kvevents_stream(kafka_bootstrap: str, kafka_topic_factory: Callable[..., str]) -> Callable[..., Any]:
    """``kvevents_stream(topic=None, partitions=1, **options)``: simulated engines' events in a
    fresh topic (or ``topic``), and their ground truth: a ``ProducedStream``. ``options`` go to
    :func:`kvevents.event_streams.simulate_to_topic` (``instances``, ``ranks``, ``iterations``,
    ``workload``, ``block_size``, ``codec``, ...)."""
    from kvevents.event_streams import ProducedStream, simulate_to_topic

    def produce(topic: str | None = None, *, partitions: int = 1, **options: Any) -> ProducedStream:
        name = topic or kafka_topic_factory(partitions=partitions)
        return simulate_to_topic(kafka_bootstrap, name, **options)

    return produce


@pytest.fixture(scope="session")
def schema_registry_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real Confluent-compatible schema registry's URL for the session:
    ``$KVEVENTS_TEST_SCHEMA_REGISTRY_URL`` when set (it must answer), else a local Apicurio
    Registry (``kvevents.registry.LocalRegistry``; Maven and a Java 21+ fetch and run it) started
    here and stopped at the end. No registry is a failure, never a skip."""
    from kvevents.registry import LocalRegistry, RegistryError, RegistryFetchError, registry_answers

    explicit = os.environ.get("KVEVENTS_TEST_SCHEMA_REGISTRY_URL", "").strip()
    if explicit:
        if not registry_answers(explicit, timeout=5.0):
            pytest.fail(
                f"KVEVENTS_TEST_SCHEMA_REGISTRY_URL={explicit} is set but no registry answers", pytrace=False
            )
        yield explicit
        return
    registry = LocalRegistry(tmp_path_factory.mktemp("schema-registry"), stop_with_parent=True)
    try:
        status = registry.start()
    except (RegistryError, RegistryFetchError) as exc:
        pytest.fail(f"no schema registry for the tests: {exc}", pytrace=False)
    try:
        assert status.url is not None
        yield status.url
    finally:
        registry.stop()
