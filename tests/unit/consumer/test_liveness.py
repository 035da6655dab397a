"""Worker liveness without Kafka: states from message timestamps, the close header, a restart,
messages without a key or timestamp (real confluent_kafka.Message objects built in memory)."""

from __future__ import annotations

import pytest
from confluent_kafka import TIMESTAMP_CREATE_TIME, TIMESTAMP_NOT_AVAILABLE, Message
from kvevents.consumer import Liveness
from kvevents.consumer.liveness import CONTROL_HEADER


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
