"""The Kafka the sink sections of ``bench/producer.py`` use (``KAFKA_BOOTSTRAP_SERVERS``, else a
local broker), their targets, and the sink's librdkafka settings."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

SINK_TARGETS = {"throughput_ratio_min": 0.8, "flush_to_ack_p99_ms_max": 50.0}


class Broker:
    """The Kafka the sink sections use: ``KAFKA_BOOTSTRAP_SERVERS``, else a local broker started
    once in a temporary directory (its JVM flags from ``KVEVENTS_BROKER_JVM_OPTS``)."""

    def __init__(self) -> None:
        self._broker: Any = None
        self._tmp: Any = None
        self.bootstrap: str | None = os.environ.get("KAFKA_BOOTSTRAP_SERVERS") or None
        self.source = "env" if self.bootstrap else None

    def get(self) -> str:
        if self.bootstrap is None:
            import tempfile

            from kvevents.broker import LocalBroker

            self._tmp = tempfile.TemporaryDirectory(prefix="kvevents-bench-broker-")
            self._broker = LocalBroker(Path(self._tmp.name) / "state", stop_with_parent=True)
            self._broker.start()
            self.bootstrap = self._broker.bootstrap_servers
            jvm = os.environ.get("KVEVENTS_BROKER_JVM_OPTS")
            self.source = f"local broker (JVM flags: {'default fast-start' if jvm is None else repr(jvm)})"
        return self.bootstrap

    def topic(self, stem: str, partitions: int = 1) -> str:
        import uuid

        from kvevents.consumer.topics import TopicSpec, create_topic

        name = f"bench-{stem}-{uuid.uuid4().hex[:8]}"
        create_topic(self.get(), TopicSpec(name, partitions=partitions))
        return name

    def stop(self) -> None:
        if self._broker is not None:
            self._broker.stop()
            self._broker = None
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None


BROKER = Broker()


def sink_config(bootstrap: str, **extra: Any) -> dict[str, Any]:
    return {"bootstrap.servers": bootstrap, "log_level": 3, **extra}


def sink_defaults() -> dict[str, Any]:
    from kvevents.producer import DEFAULT_PRODUCER_CONFIG

    return dict(DEFAULT_PRODUCER_CONFIG)
