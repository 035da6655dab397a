"""The latency settings of docs/OPERATIONS.md ("Freshness") are what a default sink and a default
reader hand to librdkafka (recorded at the ``Producer`` / ``Consumer`` constructor, which a real
librdkafka then accepts), and a caller's throughput settings still win."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from kvevents.consumer import EventReader
from kvevents.consumer import reader as reader_module
from kvevents.producer import KVCacheEventManager
from kvevents.producer import sink as sink_module
from kvevents.producer.sink import KafkaEventSink

MOCK = {"test.mock.num.brokers": 1, "log_level": 3}


def recording(real: Callable[[dict[str, Any]], Any], seen: list[dict[str, Any]]) -> Callable[..., Any]:
    def make(config: dict[str, Any], *args: Any, **kwargs: Any) -> Any:
        seen.append(dict(config))
        return real(config, *args, **kwargs)

    return make


def sink_settings(monkeypatch: pytest.MonkeyPatch, config: dict[str, Any]) -> dict[str, Any]:
    seen: list[dict[str, Any]] = []
    monkeypatch.setattr(sink_module, "Producer", recording(sink_module.Producer, seen))
    with KVCacheEventManager(10) as manager, KafkaEventSink(manager, "t", "i", config=config):
        pass
    assert seen, "the sink made no librdkafka producer"
    return seen[0]


def reader_settings(monkeypatch: pytest.MonkeyPatch, config: dict[str, Any] | None) -> dict[str, Any]:
    seen: list[dict[str, Any]] = []
    monkeypatch.setattr(reader_module, "Consumer", recording(reader_module.Consumer, seen))
    reader = EventReader("127.0.0.1:1", "t", group_id="g", config=config)  # subscribes: no wait
    reader.close(timeout=1)
    assert len(seen) == 1
    return seen[0]


def test_a_default_sink_sends_at_once_without_nagle(monkeypatch: pytest.MonkeyPatch) -> None:
    settings = sink_settings(monkeypatch, dict(MOCK))
    assert settings["linger.ms"] == 0
    assert settings["socket.nagle.disable"] is True
    assert settings["compression.type"] == "none" and settings["acks"] == "all"


def test_a_sink_caller_may_trade_latency_for_throughput(monkeypatch: pytest.MonkeyPatch) -> None:
    settings = sink_settings(
        monkeypatch, {**MOCK, "linger.ms": 20, "socket.nagle.disable": False, "compression.type": "zstd"}
    )
    assert settings["linger.ms"] == 20 and settings["socket.nagle.disable"] is False
    assert settings["compression.type"] == "zstd"  # fewer bytes on a slow link, more CPU


def test_a_default_reader_fetches_as_soon_as_a_byte_is_there(monkeypatch: pytest.MonkeyPatch) -> None:
    settings = reader_settings(monkeypatch, None)
    assert settings["socket.nagle.disable"] is True
    assert settings.get("fetch.min.bytes", 1) == 1  # the broker answers a fetch at the first byte
    assert settings["fetch.wait.max.ms"] == 100  # so this only bounds an idle fetch


def test_a_reader_caller_may_trade_latency_for_throughput(monkeypatch: pytest.MonkeyPatch) -> None:
    settings = reader_settings(
        monkeypatch, {"fetch.min.bytes": 65536, "fetch.wait.max.ms": 20, "socket.nagle.disable": False}
    )
    assert settings["fetch.min.bytes"] == 65536 and settings["fetch.wait.max.ms"] == 20
    assert settings["socket.nagle.disable"] is False
