"""Create and describe Kafka topics: partitions, retention, ``max.message.bytes``, cleanup policy.

``create_topic`` is idempotent: a topic that exists with the asked settings is fine, one that
exists with other settings is an error naming each difference. ``describe_topic`` reports
partitions with leaders and watermarks, and the topic's configs.
"""

from __future__ import annotations

import re
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = [
    "CLEANUP_POLICIES",
    "PartitionInfo",
    "TopicDescription",
    "TopicError",
    "TopicMismatch",
    "TopicSpec",
    "create_topic",
    "describe_topic",
    "quiet_client_config",
    "topic_mismatches",
]

CLEANUP_POLICIES = frozenset({"delete", "compact", "compact,delete", "delete,compact"})
_TOPIC_NAME = re.compile(r"[a-zA-Z0-9._-]{1,249}")


def quiet_client_config(bootstrap_servers: str, **overrides: Any) -> dict[str, Any]:
    """A librdkafka client config that reconnects quickly and does not print connection errors.

    While a broker starts, every refused connection would otherwise be logged to stderr.
    """
    config: dict[str, Any] = {
        "bootstrap.servers": bootstrap_servers,
        "log_level": 0,
        "reconnect.backoff.ms": 50,
        "reconnect.backoff.max.ms": 250,
        "socket.connection.setup.timeout.ms": 2000,
    }
    config.update(overrides)
    return config


class TopicError(RuntimeError):
    """A topic could not be created or described."""


class TopicMismatch(TopicError):
    """The topic exists with settings other than the ones asked for."""


@dataclass(frozen=True)
class TopicSpec:
    """A topic to create. ``None`` settings take the broker's defaults."""

    name: str
    partitions: int = 1
    replication_factor: int = 1
    retention_ms: int | None = None
    """``retention.ms``; -1 keeps data forever."""
    max_message_bytes: int | None = None
    """``max.message.bytes``: the largest record batch the topic accepts."""
    cleanup_policy: str | None = None
    """``cleanup.policy``: ``delete``, ``compact`` or ``compact,delete``."""
    configs: Mapping[str, str] = field(default_factory=dict)
    """Any further topic configs, by their Kafka names."""

    def __post_init__(self) -> None:
        if not _TOPIC_NAME.fullmatch(self.name) or self.name in (".", ".."):
            raise ValueError(
                f"invalid topic name {self.name!r}: use 1-249 characters of a-z, A-Z, 0-9, '.', '_', '-'"
            )
        if self.partitions < 1:
            raise ValueError(f"partitions must be >= 1, got {self.partitions}")
        if self.replication_factor < 1:
            raise ValueError(f"replication factor must be >= 1, got {self.replication_factor}")
        if self.retention_ms is not None and self.retention_ms < -1:
            raise ValueError(f"retention.ms must be -1 (forever) or >= 0, got {self.retention_ms}")
        if self.max_message_bytes is not None and self.max_message_bytes < 1:
            raise ValueError(f"max.message.bytes must be >= 1, got {self.max_message_bytes}")
        if self.cleanup_policy is not None and self.cleanup_policy not in CLEANUP_POLICIES:
            raise ValueError(
                f"cleanup.policy {self.cleanup_policy!r} is not one of {sorted(CLEANUP_POLICIES)}"
            )

    def topic_configs(self) -> dict[str, str]:
        """The topic-level configs this spec sets, by Kafka name."""
        configs = {key: str(value) for key, value in self.configs.items()}
        if self.retention_ms is not None:
            configs["retention.ms"] = str(self.retention_ms)
        if self.max_message_bytes is not None:
            configs["max.message.bytes"] = str(self.max_message_bytes)
        if self.cleanup_policy is not None:
            configs["cleanup.policy"] = self.cleanup_policy
        return configs


@dataclass(frozen=True)
class PartitionInfo:
    """One partition: its leader, replicas and offsets (the high watermark is the next offset)."""

    partition: int
    leader: int | None
    replicas: tuple[int, ...]
    isr: tuple[int, ...]
    low_watermark: int
    high_watermark: int

    @property
    def messages(self) -> int:
        """Records retained in the partition (high minus low watermark)."""
        return self.high_watermark - self.low_watermark


@dataclass(frozen=True)
class TopicDescription:
    """What ``describe_topic`` found."""

    name: str
    topic_id: str
    partitions: tuple[PartitionInfo, ...]
    configs: dict[str, str]
    """Every config of the topic with its effective value."""
    overrides: dict[str, str]
    """The configs set on the topic itself (not broker or built-in defaults)."""

    @property
    def retention_ms(self) -> int:
        return int(self.configs["retention.ms"])

    @property
    def max_message_bytes(self) -> int:
        return int(self.configs["max.message.bytes"])

    @property
    def cleanup_policy(self) -> str:
        return self.configs["cleanup.policy"]

    @property
    def messages(self) -> int:
        return sum(p.messages for p in self.partitions)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        data = asdict(self)
        data["messages"] = self.messages
        return data


def _admin(bootstrap_servers: str, config: Mapping[str, Any] | None = None) -> Any:
    from confluent_kafka.admin import AdminClient

    return AdminClient(quiet_client_config(bootstrap_servers, **dict(config or {})))


def _policy_set(value: str) -> frozenset[str]:
    return frozenset(part.strip() for part in value.split(",") if part.strip())


def topic_mismatches(spec: TopicSpec, description: TopicDescription) -> list[str]:
    """How an existing topic differs from ``spec`` (empty when it matches)."""
    problems = []
    if len(description.partitions) != spec.partitions:
        problems.append(f"partitions: wanted {spec.partitions}, topic has {len(description.partitions)}")
    replicas = {len(p.replicas) for p in description.partitions}
    if replicas and replicas != {spec.replication_factor}:
        problems.append(f"replication factor: wanted {spec.replication_factor}, topic has {sorted(replicas)}")
    for key, wanted in spec.topic_configs().items():
        actual = description.configs.get(key)
        same = (
            _policy_set(wanted) == _policy_set(actual)
            if key == "cleanup.policy" and actual is not None
            else actual == wanted
        )
        if not same:
            problems.append(f"{key}: wanted {wanted}, topic has {actual}")
    return problems


def create_topic(
    bootstrap_servers: str, spec: TopicSpec, timeout: float = 30.0, config: Mapping[str, Any] | None = None
) -> bool:
    """Create the topic and wait until every partition has a leader (``config``: more client
    settings, e.g. security).

    Returns True when it was created, False when it already existed with the same settings;
    raises :class:`TopicMismatch` when it exists with other settings.
    """
    from confluent_kafka import KafkaError, KafkaException
    from confluent_kafka.admin import NewTopic

    admin = _admin(bootstrap_servers, config)
    new = NewTopic(
        spec.name,
        num_partitions=spec.partitions,
        replication_factor=spec.replication_factor,
        config=spec.topic_configs(),
    )
    future = admin.create_topics([new], operation_timeout=timeout, request_timeout=timeout)[spec.name]
    try:
        future.result(timeout=timeout + 5)
    except KafkaException as exc:
        error = exc.args[0]
        if error.code() != KafkaError.TOPIC_ALREADY_EXISTS:
            raise TopicError(
                f"cannot create topic {spec.name!r} on {bootstrap_servers}: {error.str()}"
            ) from exc
        existing = describe_topic(bootstrap_servers, spec.name, timeout, config)
        problems = topic_mismatches(spec, existing)
        if problems:
            raise TopicMismatch(
                f"topic {spec.name!r} already exists with other settings: " + "; ".join(problems)
            ) from exc
        return False
    _wait_for_leaders(admin, spec.name, spec.partitions, timeout)
    return True


_NOT_READY_YET = frozenset(
    {
        "NOT_LEADER_FOR_PARTITION",
        "LEADER_NOT_AVAILABLE",
        "UNKNOWN_TOPIC_OR_PART",
        "_UNKNOWN_PARTITION",
        "_UNKNOWN_TOPIC",
    }
)


def _not_ready_yet(error: Any) -> bool:
    """Errors a broker gives for a topic created a moment ago, until its metadata settles."""
    return bool(error.retriable()) or error.name() in _NOT_READY_YET


def _watermarks(
    admin: Any, name: str, ids: list[int], deadline: float
) -> tuple[dict[int, int], dict[int, int]]:
    """Low and high watermark per partition, retrying while a new topic's leaders settle."""
    from confluent_kafka import KafkaException, TopicPartition
    from confluent_kafka.admin import OffsetSpec

    while True:
        request_timeout = max(1.0, min(10.0, deadline - time.monotonic()))
        try:
            marks = []
            for spec in (OffsetSpec.earliest(), OffsetSpec.latest()):
                futures = admin.list_offsets(
                    {TopicPartition(name, i): spec for i in ids}, request_timeout=request_timeout
                )
                marks.append({tp.partition: future.result().offset for tp, future in futures.items()})
            return marks[0], marks[1]
        except KafkaException as exc:
            if not _not_ready_yet(exc.args[0]) or time.monotonic() >= deadline:
                raise
        time.sleep(0.05)


def _wait_for_leaders(admin: Any, name: str, partitions: int, timeout: float) -> None:
    """Wait until every partition has a leader that answers offset requests."""
    from confluent_kafka import KafkaException, TopicCollection

    deadline = time.monotonic() + timeout
    while True:
        try:
            found = admin.describe_topics(TopicCollection([name]), request_timeout=5)[name].result()
            leaders = [p.leader for p in found.partitions]
            if len(leaders) == partitions and all(leader is not None for leader in leaders):
                _watermarks(admin, name, [p.id for p in found.partitions], deadline)
                return
        except KafkaException:
            pass  # not yet known to the broker we asked
        if time.monotonic() >= deadline:
            raise TopicError(
                f"topic {name!r} was created but its partitions have no leader after {timeout:.0f} s"
            )
        time.sleep(0.05)


def describe_topic(
    bootstrap_servers: str, name: str, timeout: float = 30.0, config: Mapping[str, Any] | None = None
) -> TopicDescription:
    """Partitions (leader, replicas, in-sync replicas, watermarks) and configs of a topic."""
    from confluent_kafka import KafkaError, KafkaException, TopicCollection
    from confluent_kafka.admin import ConfigResource, ConfigSource, ResourceType

    deadline = time.monotonic() + timeout
    admin = _admin(bootstrap_servers, config)
    try:
        topic = admin.describe_topics(TopicCollection([name]), request_timeout=timeout)[name].result()
    except KafkaException as exc:
        error = exc.args[0]
        if error.code() == KafkaError.UNKNOWN_TOPIC_OR_PART:
            raise TopicError(f"topic {name!r} does not exist on {bootstrap_servers}") from exc
        raise TopicError(f"cannot describe topic {name!r} on {bootstrap_servers}: {error.str()}") from exc
    try:
        resource = ConfigResource(ResourceType.TOPIC, name)
        entries = admin.describe_configs([resource], request_timeout=timeout)[resource].result()
        low, high = _watermarks(admin, name, [p.id for p in topic.partitions], deadline)
    except KafkaException as exc:
        raise TopicError(
            f"cannot describe topic {name!r} on {bootstrap_servers}: {exc.args[0].str()}"
        ) from exc
    partitions = tuple(
        PartitionInfo(
            partition=p.id,
            leader=p.leader.id if p.leader is not None else None,
            replicas=tuple(node.id for node in p.replicas),
            isr=tuple(node.id for node in p.isr),
            low_watermark=low[p.id],
            high_watermark=high[p.id],
        )
        for p in sorted(topic.partitions, key=lambda p: p.id)
    )
    configs = {key: entry.value for key, entry in sorted(entries.items())}
    overrides = {
        key: entry.value
        for key, entry in sorted(entries.items())
        if entry.source == ConfigSource.DYNAMIC_TOPIC_CONFIG.value
    }
    return TopicDescription(name, str(topic.topic_id), partitions, configs, overrides)
