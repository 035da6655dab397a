"""Worker liveness without Kafka: states from message timestamps, the close header, a restart,
messages without a key or timestamp (real confluent_kafka.Message objects built in memory)."""

from __future__ import annotations

import pytest
from confluent_kafka import TIMESTAMP_CREATE_TIME, TIMESTAMP_NOT_AVAILABLE, Message
from kvevents.consumer import CacheIndex, Liveness, WorkerKey
from kvevents.consumer.liveness import CONTROL_HEADER, not_routable_workers
from kvevents.schemas import EventBatch, KVCacheCreatedData, KVCacheEvent


def message(key: bytes | None, at_ms: int | None, headers: list[tuple[str, bytes]] | None = None) -> Message:
    kind, stamp = (TIMESTAMP_NOT_AVAILABLE, 0) if at_ms is None else (TIMESTAMP_CREATE_TIME, at_ms)
    return Message(
        topic="t", partition=0, offset=0, key=key, value=b"", headers=headers, timestamp=(kind, stamp)
    )


def test_live_then_stale_after_the_ttl_by_message_time() -> None:
    now = [1000.0]
    liveness = Liveness(10.0, clock=lambda: now[0])
    assert liveness.observe_message(message(b"a", 995_000)) is None
    liveness.observe_message(message(b"b", 985_000))  # an old message, e.g. during a rebuild
    assert liveness.state("a") == "live" and liveness.state("b") == "stale"
    now[0] = 1006.0
    assert liveness.state("a") == "stale"
    liveness.observe_message(message(b"a", 990_000))  # older than what was heard: no step back
    assert liveness.instance("a").last_heard_s == 995.0 and liveness.instance("a").messages == 2
    assert liveness.not_routable(["a", "b", "unknown"]) == {"a": "stale", "b": "stale"}


def test_close_header_then_a_restart() -> None:
    now = [1000.0]
    liveness = Liveness(10.0, clock=lambda: now[0])
    assert liveness.observe_message(message(b"a", 999_000, [(CONTROL_HEADER, b"close")])) == "a"
    assert liveness.state("a") == "closed" and liveness.closes == 1
    liveness.observe_message(message(b"a", 999_500, [("other", b"x")]))  # the instance is back
    assert liveness.state("a") == "live"


def test_messages_without_key_or_timestamp() -> None:
    now = [1000.0]
    liveness = Liveness(10.0, clock=lambda: now[0])
    assert liveness.observe_message(message(None, 999_000)) is None  # not attributed
    liveness.observe_message(message(b"a", None))  # no timestamp: heard now
    assert liveness.instance("a").last_heard_s == 1000.0
    now[0] = 1005.0
    assert liveness.state("never-heard") == "live"  # e.g. restored from a checkpoint: a grace period
    now[0] = 1011.0
    assert liveness.state("never-heard") == "stale"
    with pytest.raises(ValueError, match="stale_after_s"):
        Liveness(0)


def test_not_routable_workers_lists_only_the_workers_of_stale_and_closed_instances() -> None:
    index = CacheIndex()
    for name in ("live", "quiet", "gone", "never-heard"):
        events = [KVCacheEvent(0, KVCacheCreatedData([4]), 16, r) for r in range(2)]
        index.apply(EventBatch(name, events, attention_dp_size=2))
    clock = [1000.0]
    liveness = Liveness(10.0, clock=lambda: clock[0])
    liveness.observe("live", 1000.0)
    liveness.observe("quiet", 985.0)
    liveness.observe("gone", 999.0, closing=True)
    states = not_routable_workers(index, liveness)
    assert states == {
        WorkerKey("gone", 0): "closed", WorkerKey("gone", 1): "closed",
        WorkerKey("quiet", 0): "stale", WorkerKey("quiet", 1): "stale",
    }  # fmt: skip
    clock[0] = 1011.0  # tracking started at 1000: an instance never heard is stale 10 s later
    later = not_routable_workers(index, liveness)
    assert later[WorkerKey("never-heard", 1)] == "stale" and WorkerKey("live", 0) in later
    clock[0] = 1005.0
    liveness.observe("quiet", 1005.0)
    assert set(not_routable_workers(index, liveness)) == {WorkerKey("gone", 0), WorkerKey("gone", 1)}
