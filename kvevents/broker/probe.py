"""Is a Kafka broker answering? A metadata request through confluent_kafka's AdminClient."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

from kvevents.consumer.topics import quiet_client_config

__all__ = ["BrokerNotAnswering", "metadata_answers", "quiet_client_config", "wait_for_metadata"]


class BrokerNotAnswering(TimeoutError):
    """No metadata answer within the time allowed."""


def metadata_answers(
    bootstrap_servers: str, timeout: float = 2.0, config: Mapping[str, Any] | None = None
) -> bool:
    """Whether a broker at ``bootstrap_servers`` answers a metadata request within ``timeout``
    (``config``: further client settings, e.g. security)."""
    from confluent_kafka import KafkaException
    from confluent_kafka.admin import AdminClient

    admin = AdminClient(quiet_client_config(bootstrap_servers, **(config or {})))
    try:
        return bool(admin.list_topics(timeout=timeout).brokers)
    except KafkaException:
        return False


def wait_for_metadata(
    bootstrap_servers: str,
    timeout: float,
    failed: Callable[[], str | None] = lambda: None,
    interval: float = 0.1,
    config: Mapping[str, Any] | None = None,
) -> float:
    """Poll until a metadata request is answered; return the seconds waited.

    ``failed`` is asked between attempts and returns a reason when waiting is pointless (the
    broker process exited): that reason is raised as ``RuntimeError`` at once. After
    ``timeout`` seconds raise :class:`BrokerNotAnswering`.
    """
    from confluent_kafka import KafkaException
    from confluent_kafka.admin import AdminClient

    started = time.monotonic()
    deadline = started + timeout
    admin = AdminClient(quiet_client_config(bootstrap_servers, **(config or {})))
    last_error = "no attempt made"
    while True:
        reason = failed()
        if reason is not None:
            raise RuntimeError(reason)
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise BrokerNotAnswering(
                f"no metadata answer from {bootstrap_servers} within {timeout:.0f} s (last error: {last_error})"
            )
        try:
            metadata = admin.list_topics(timeout=min(1.0, max(remaining, 0.05)))
        except KafkaException as exc:
            last_error = str(exc.args[0]) if exc.args else repr(exc)
        else:
            if metadata.brokers:
                return time.monotonic() - started
            last_error = "metadata listed no broker"
        time.sleep(interval)
