"""The reader's parts that need no broker: argument checks, metrics arithmetic, DLQ settings."""

from __future__ import annotations

import time

import pytest
from kvevents.consumer import EventReader, PartitionState, ReadResult
from kvevents.consumer.dead_letter import dead_letter_producer_config
from kvevents.consumer.reader_metrics import ThroughputMeter


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"start": "middle"}, "start must be 'beginning', 'end' or a mapping"),
        ({"group_id": "g", "partitions": [0]}, "a consumer group gets its partitions"),
        ({"group_id": "g", "start": {0: 5}}, "a consumer group gets its partitions"),
        ({"consume_batch": 0}, "consume_batch must be >= 1"),
    ],
)
def test_bad_arguments_are_refused_before_connecting(kwargs, message):
    with pytest.raises(ValueError, match=message):
        EventReader("127.0.0.1:1", "topic", **kwargs)
    with pytest.raises(ValueError, match="topic must be"):
        EventReader("127.0.0.1:1", "")


def test_lag_is_the_watermark_minus_the_position_and_unknown_without_either():
    assert PartitionState(0, 10, 25, 25, False).lag == 15
    assert PartitionState(0, 30, 25, 25, True).lag == 0
    assert PartitionState(0, None, 25, 25, False).lag is None


def test_throughput_overall_and_recent():
    meter = ThroughputMeter(window_s=0.05)
    meter.add(10, 100, 1000)
    time.sleep(0.06)
    meter.sample()
    meter.add(5, 50, 500)
    time.sleep(0.06)  # recent: from the newest sample at least window_s old (the one above)
    overall, recent = meter.overall(), meter.recent()
    assert overall.events_per_s == pytest.approx(150 / overall.seconds)
    assert recent.seconds < overall.seconds and recent.events_per_s == pytest.approx(
        50 / recent.seconds, rel=0.2
    )
    assert ReadResult(1, 100, 10, 0, 2.0, True).events_per_s == 50.0
    assert ReadResult(0, 0, 0, 0, 0.0, True).events_per_s == 0.0


def test_the_dead_letter_producer_shares_connection_and_security_settings_only():
    config = dead_letter_producer_config(
        {
            "bootstrap.servers": "b:9092",
            "security.protocol": "SASL_SSL",
            "sasl.username": "u",
            "ssl.ca.location": "/ca",
            "client.id": "router",
            "group.id": "g",
            "fetch.max.bytes": 1,
            "auto.offset.reset": "earliest",
        }
    )
    assert config == {
        "bootstrap.servers": "b:9092",
        "security.protocol": "SASL_SSL",
        "sasl.username": "u",
        "ssl.ca.location": "/ca",
        "client.id": "router",
        "enable.idempotence": True,
        "linger.ms": 50,
    }
