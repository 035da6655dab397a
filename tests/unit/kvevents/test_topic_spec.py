"""Topic specs and how an existing topic is compared with one: no broker needed."""

from __future__ import annotations

import pytest
from kvevents.consumer.topics import PartitionInfo, TopicDescription, TopicSpec, topic_mismatches


def description(partitions: int = 1, replicas: int = 1, **configs: str) -> TopicDescription:
    defaults = {"retention.ms": "604800000", "max.message.bytes": "1048588", "cleanup.policy": "delete"}
    defaults.update({k.replace("_", "."): v for k, v in configs.items()})
    parts = tuple(
        PartitionInfo(i, 1, tuple(range(1, replicas + 1)), (1,), low_watermark=2, high_watermark=7)
        for i in range(partitions)
    )
    return TopicDescription("t", "id", parts, defaults, {})


def test_spec_turns_settings_into_kafka_configs() -> None:
    spec = TopicSpec(
        "kv-events", partitions=4, retention_ms=-1, max_message_bytes=8 << 20, cleanup_policy="compact",
        configs={"segment.ms": "60000"},
    )  # fmt: skip
    assert spec.topic_configs() == {
        "retention.ms": "-1",
        "max.message.bytes": str(8 << 20),
        "cleanup.policy": "compact",
        "segment.ms": "60000",
    }
    assert TopicSpec("plain").topic_configs() == {}


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"name": ""}, "invalid topic name"),
        ({"name": "a/b"}, "invalid topic name"),
        ({"name": ".."}, "invalid topic name"),
        ({"name": "x" * 250}, "invalid topic name"),
        ({"name": "t", "partitions": 0}, "partitions must be >= 1"),
        ({"name": "t", "replication_factor": 0}, "replication factor"),
        ({"name": "t", "retention_ms": -2}, "retention.ms"),
        ({"name": "t", "max_message_bytes": 0}, "max.message.bytes"),
        ({"name": "t", "cleanup_policy": "shred"}, "cleanup.policy 'shred'"),
    ],
)
def test_bad_specs_are_rejected_with_the_reason(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        TopicSpec(**kwargs)  # type: ignore[arg-type]


def test_a_matching_topic_has_no_mismatch() -> None:
    spec = TopicSpec("t", partitions=3, retention_ms=1000, cleanup_policy="compact,delete")
    assert topic_mismatches(spec, description(3, retention_ms="1000", cleanup_policy="delete,compact")) == []


def test_settings_not_asked_for_are_not_compared() -> None:
    assert topic_mismatches(TopicSpec("t"), description(1, retention_ms="5")) == []


def test_every_difference_is_named() -> None:
    spec = TopicSpec("t", partitions=2, replication_factor=1, max_message_bytes=100, cleanup_policy="compact")
    problems = topic_mismatches(spec, description(3, replicas=2))
    assert problems == [
        "partitions: wanted 2, topic has 3",
        "replication factor: wanted 1, topic has [2]",
        "max.message.bytes: wanted 100, topic has 1048588",
        "cleanup.policy: wanted compact, topic has delete",
    ]


def test_description_totals_and_typed_configs() -> None:
    found = description(3, retention_ms="42")
    assert found.messages == 15
    assert (
        found.retention_ms == 42 and found.max_message_bytes == 1048588 and found.cleanup_policy == "delete"
    )
    assert found.to_dict()["messages"] == 15
    assert found.to_dict()["partitions"][0]["high_watermark"] == 7
