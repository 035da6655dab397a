"""Kafka and schema-registry settings of a command, and a quick check before the real work.

- :func:`read_properties`: a librdkafka properties file (``-F FILE``, as kcat reads it:
  ``key=value`` lines, ``#`` comments);
- :func:`split_settings`: Kafka client settings apart from schema-registry ones
  (``schema.registry.url``, ``schema.registry.<client setting>``, ``basic.auth.user.info``),
  which librdkafka would refuse;
- :func:`check_kafka`: one metadata request with a short timeout, so that a wrong address, an
  unknown topic or a bad setting is one line naming it, within seconds, not a stream of
  librdkafka's reconnect logs.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

__all__ = [
    "CONNECT_TIMEOUT_ENV",
    "LIBRDKAFKA_LOGGERS",
    "KafkaCheckFailed",
    "check_kafka",
    "connect_timeout",
    "read_properties",
    "split_settings",
]

CONNECT_TIMEOUT_ENV = "KVEVENTS_CONNECT_TIMEOUT"
"""Seconds a command waits for the broker's first answer (default 5)."""
LIBRDKAFKA_LOGGERS = (
    "kvevents.librdkafka",
    "kvevents.consumer.librdkafka",
    "kvevents.producer.librdkafka",
)
"""Where kvevents sends librdkafka's own log lines; the CLI shows them only with ``-v``."""
_DEFAULT_CONNECT_TIMEOUT_S = 5.0
_REGISTRY_PREFIX = "schema.registry."
_REGISTRY_BARE = ("basic.auth.user.info", "basic.auth.credentials.source")


class KafkaCheckFailed(Exception):
    """The check failed; the message is one line for the user."""


def read_properties(path: Path) -> list[tuple[str, str]]:
    """The ``key=value`` pairs of a properties file, in order; ValueError naming a bad line."""
    try:
        text = path.read_text()
    except OSError as exc:
        raise ValueError(f"cannot read the properties file {path}: {exc.strerror or exc}") from None
    pairs: list[tuple[str, str]] = []
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith(("#", "!")):
            continue
        key, sep, value = line.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"{path}:{number}: expected KEY=VALUE")  # never echo: it may hold a secret
        pairs.append((key.strip(), value.strip()))
    return pairs


def split_settings(pairs: Iterable[tuple[str, str]]) -> tuple[dict[str, str], dict[str, str]]:
    """``(kafka, registry)``: librdkafka settings, and the schema registry client's settings
    (``url``, ``basic.auth.user.info``, ``ssl.ca.location``, ...), a later pair winning."""
    kafka: dict[str, str] = {}
    registry: dict[str, str] = {}
    for key, value in pairs:
        if key.startswith(_REGISTRY_PREFIX):
            registry[key[len(_REGISTRY_PREFIX) :]] = value
        elif key in _REGISTRY_BARE:
            registry[key] = value
        else:
            kafka[key] = value
    registry.pop("basic.auth.credentials.source", None)  # Java's switch; the client needs none
    return kafka, registry


def connect_timeout() -> float:
    """``$KVEVENTS_CONNECT_TIMEOUT`` seconds, else 5."""
    raw = os.environ.get(CONNECT_TIMEOUT_ENV, "").strip()
    try:
        return float(raw) if raw else _DEFAULT_CONNECT_TIMEOUT_S
    except ValueError:
        return _DEFAULT_CONNECT_TIMEOUT_S


def _setting_problem(message: str) -> str:
    return f"bad Kafka client setting (from -X or -F): {message}"


def check_kafka(
    bootstrap: str,
    config: Mapping[str, Any],
    *,
    topic: str | None = None,
    role: str = "consumer",
    timeout: float | None = None,
) -> None:
    """Validate ``config`` with a ``role`` client ("consumer" or "producer") and ask the broker
    for metadata (of ``topic`` when given); raise :class:`KafkaCheckFailed` with one line when
    the setting is refused, no broker answers within ``timeout`` seconds, or the topic is missing."""
    from confluent_kafka import Consumer, KafkaError, KafkaException, Producer

    timeout = connect_timeout() if timeout is None else timeout
    settings: dict[str, Any] = dict(config)
    settings["bootstrap.servers"] = bootstrap
    settings["logger"] = logging.getLogger(LIBRDKAFKA_LOGGERS[0])
    down: list[Any] = []
    settings["error_cb"] = lambda err: (
        down.append(err) if err.code() == KafkaError._ALL_BROKERS_DOWN else None
    )
    settings.setdefault("socket.connection.setup.timeout.ms", max(1000, int(timeout * 1000)))
    client: Any
    try:
        if role == "producer":
            client = Producer(settings)
        else:
            settings.setdefault("group.id", "kvevents-cli-check")
            client = Consumer(settings)
    except KafkaException as exc:
        raise KafkaCheckFailed(_setting_problem(_kafka_message(exc))) from None
    except (TypeError, ValueError) as exc:
        raise KafkaCheckFailed(_setting_problem(str(exc))) from None
    try:
        metadata = _metadata(client, topic, timeout, down)
    except KafkaException as exc:
        err = exc.args[0] if exc.args and isinstance(exc.args[0], KafkaError) else None
        if err is not None and err.code() in (KafkaError._TRANSPORT, KafkaError._TIMED_OUT):
            why = f"cannot connect ({down[0].str()})" if down else f"no answer within {timeout:g} s"
            raise KafkaCheckFailed(
                f"no Kafka broker answers at {bootstrap}: {why} "
                "(is it running? check --bootstrap-servers / KAFKA_BOOTSTRAP_SERVERS; -v shows librdkafka's log)"
            ) from None
        raise KafkaCheckFailed(f"Kafka at {bootstrap}: {_kafka_message(exc)}") from None
    finally:
        if role == "producer":
            client.flush(0)
        else:
            client.close()
    if topic is None:
        return
    info = metadata.topics.get(topic)
    if info is None or (info.error is not None and info.error.code() == KafkaError.UNKNOWN_TOPIC_OR_PART):
        raise KafkaCheckFailed(
            f"topic {topic!r} does not exist at {bootstrap} (create it: kvevents topic create {topic})"
        )
    if info.error is not None:
        raise KafkaCheckFailed(f"topic {topic!r} at {bootstrap}: {info.error.str()}")


def _metadata(client: Any, topic: str | None, timeout: float, down: list[Any]) -> Any:
    """``list_topics`` in short steps, serving callbacks between them, so that every broker
    refusing the connection (``_ALL_BROKERS_DOWN``) ends the wait at once."""
    from confluent_kafka import KafkaError, KafkaException

    deadline = time.monotonic() + timeout
    while True:
        step = max(0.05, min(0.5, deadline - time.monotonic()))
        try:
            return client.list_topics(topic, timeout=step)
        except KafkaException as exc:
            err = exc.args[0] if exc.args and isinstance(exc.args[0], KafkaError) else None
            retry = err is not None and err.code() in (KafkaError._TRANSPORT, KafkaError._TIMED_OUT)
            client.poll(0)  # serves error_cb
            if not retry or down or time.monotonic() >= deadline:
                raise


def _kafka_message(exc: BaseException) -> str:
    from confluent_kafka import KafkaError

    err = exc.args[0] if exc.args else None
    return err.str() if isinstance(err, KafkaError) else str(exc)
