"""The sink's librdkafka settings: defaults, unchanged pass-through, bootstrap, size limit."""

from __future__ import annotations

import pytest
from kvevents.producer.sink_config import (
    DEFAULT_PRODUCER_CONFIG,
    admin_config,
    bool_setting,
    int_setting,
    message_limit,
    producer_config,
)


def test_defaults_fill_in_what_the_caller_left_out(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KAFKA_BOOTSTRAP_SERVERS", raising=False)
    config = producer_config({"bootstrap.servers": "k:9092"})
    assert config == {**DEFAULT_PRODUCER_CONFIG, "bootstrap.servers": "k:9092"}
    assert config["enable.idempotence"] is True and config["acks"] == "all"
    assert config["compression.type"] == "none" and config["partitioner"] == "murmur2_random"
    assert config["linger.ms"] == 0 and config["message.timeout.ms"] == 0  # freshness: OPERATIONS.md


def test_every_given_setting_passes_through_unchanged(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KAFKA_BOOTSTRAP_SERVERS", "from-env:1")
    given = {
        "bootstrap.servers": "a:1,b:2",
        "security.protocol": "SASL_SSL",
        "sasl.mechanism": "SCRAM-SHA-512",
        "sasl.username": "u",
        "sasl.password": "p",
        "ssl.ca.location": "/etc/ca.pem",
        "acks": 1,
        "compression.type": "lz4",
        "linger.ms": "50",
        "message.timeout.ms": 30_000,
    }
    config = producer_config(given)
    for key, value in given.items():
        assert config[key] == value
    assert config["enable.idempotence"] is True  # untouched defaults stay


def test_bootstrap_comes_from_the_environment_or_fails_clearly(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KAFKA_BOOTSTRAP_SERVERS", " env:9092 ")
    assert producer_config(None)["bootstrap.servers"] == "env:9092"
    monkeypatch.delenv("KAFKA_BOOTSTRAP_SERVERS")
    with pytest.raises(ValueError, match="KAFKA_BOOTSTRAP_SERVERS"):
        producer_config({"acks": "all"})


def test_bad_configs_are_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KAFKA_BOOTSTRAP_SERVERS", "k:1")
    with pytest.raises(TypeError, match="mapping"):
        producer_config([("acks", "all")])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="names"):
        producer_config({1: "x"})  # type: ignore[dict-item]
    with pytest.raises(ValueError, match=r"message\.max\.bytes"):
        int_setting({"message.max.bytes": "lots"}, "message.max.bytes", 1)


def test_admin_config_keeps_connection_settings_and_drops_producer_callbacks() -> None:
    config = {
        "bootstrap.servers": "k:1",
        "sasl.username": "u",
        "error_cb": print,
        "on_delivery": print,
        "logger": 1,
    }
    assert admin_config(config) == {"bootstrap.servers": "k:1", "sasl.username": "u", "logger": 1}


def test_the_message_limit_is_the_smaller_of_producer_and_topic() -> None:
    assert message_limit(1_000_000, None) == 1_000_000
    assert message_limit(1_000_000, 4096) == 4096
    assert message_limit(2000, 1_048_588) == 2000
    assert int_setting({"message.max.bytes": "2000"}, "message.max.bytes", 1) == 2000
    assert int_setting({}, "batch.size", 7) == 7


@pytest.mark.parametrize(
    ("value", "expected"),
    [(None, True), (True, True), (False, False), ("true", True), ("TRUE", True), ("t", True), ("1", True),
     ("false", False), ("F", False), ("0", False), (" false ", False)],
)  # fmt: skip
def test_bool_settings_read_as_librdkafka_reads_them(value: object, expected: bool) -> None:
    config = {} if value is None else {"enable.idempotence": value}
    assert bool_setting(config, "enable.idempotence", True) is expected


def test_a_bool_setting_that_is_neither_is_named() -> None:
    with pytest.raises(ValueError, match=r"'enable\.idempotence' must be true or false, got 'yes please'"):
        bool_setting({"enable.idempotence": "yes please"}, "enable.idempotence", True)
