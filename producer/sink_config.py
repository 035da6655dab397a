"""The Kafka sink's librdkafka configuration: defaults, pass-through, and the message size budget.

Every setting the caller gives is passed to librdkafka unchanged; the defaults only fill in what
the caller left out (``bootstrap.servers`` falls back to ``KAFKA_BOOTSTRAP_SERVERS``). Why each
default: ``docs/OPERATIONS.md``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

__all__ = [
    "BOOTSTRAP_ENV",
    "DEFAULT_PRODUCER_CONFIG",
    "IDEMPOTENT_WINDOW",
    "LIBRDKAFKA_DEFAULT_BATCH_SIZE",
    "LIBRDKAFKA_DEFAULT_MESSAGE_MAX_BYTES",
    "SIZE_SAFETY_MARGIN",
    "admin_config",
    "bool_setting",
    "int_setting",
    "message_limit",
    "producer_config",
]

BOOTSTRAP_ENV = "KAFKA_BOOTSTRAP_SERVERS"

DEFAULT_PRODUCER_CONFIG: dict[str, Any] = {
    "enable.idempotence": True,
    "acks": "all",
    "compression.type": "none",
    "linger.ms": 0,
    "socket.nagle.disable": True,
    "partitioner": "murmur2_random",
    "message.timeout.ms": 0,
    "queue.buffering.max.kbytes": 32 * 1024,
    "queue.buffering.max.messages": 10_000,
}
"""What the sink sets unless the caller's config says otherwise."""

IDEMPOTENT_WINDOW = 5
"""Messages of a partition an idempotent librdkafka producer leaves unacknowledged
(``RD_KAFKA_IDEMP_MAX_INFLIGHT``, counted in messages, not requests): it sends nothing more of
that partition until an acknowledgement comes back, and with ``linger.ms=0`` its broker thread
polls in a tight loop meanwhile. The sink hands nothing over while this many are
unacknowledged, and then everything it kept (docs/OPERATIONS.md, "The sink's hand-off window")."""

LIBRDKAFKA_DEFAULT_MESSAGE_MAX_BYTES = 1_000_000
LIBRDKAFKA_DEFAULT_BATCH_SIZE = 1_000_000

SIZE_SAFETY_MARGIN = 512
"""Bytes kept free below the limit for librdkafka's record framing, the record batch header and
compression's worst case on a batch that does not compress (on top of key and headers, which are
counted exactly)."""

_PRODUCER_CALLBACKS = frozenset({"error_cb", "stats_cb", "throttle_cb", "on_delivery"})


def producer_config(config: Mapping[str, Any] | None) -> dict[str, Any]:
    """The librdkafka config the sink uses: ``config`` unchanged over :data:`DEFAULT_PRODUCER_CONFIG`.

    Raises ``ValueError`` when there is no ``bootstrap.servers`` (neither in ``config`` nor in
    ``$KAFKA_BOOTSTRAP_SERVERS``; librdkafka's mock cluster, ``test.mock.num.brokers``, needs none) or a key is not a string, ``TypeError`` when ``config`` is
    not a mapping.
    """
    if config is None:
        config = {}
    if not isinstance(config, Mapping):
        raise TypeError(f"config must be a mapping of librdkafka settings, got {type(config).__name__}")
    for key in config:
        if not isinstance(key, str) or not key:
            raise ValueError(f"librdkafka setting names are non-empty strings, got {key!r}")
    merged = dict(DEFAULT_PRODUCER_CONFIG)
    merged.update(config)
    if not str(merged.get("bootstrap.servers", "")).strip() and "test.mock.num.brokers" not in merged:
        from_env = os.environ.get(BOOTSTRAP_ENV, "").strip()
        if not from_env:
            raise ValueError(f"no Kafka address: put 'bootstrap.servers' in config or set {BOOTSTRAP_ENV}")
        merged["bootstrap.servers"] = from_env
    return merged


def admin_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """The settings an AdminClient shares with the producer (connection, security, logger),
    without the callbacks that belong to the producer."""
    return {key: value for key, value in config.items() if key not in _PRODUCER_CALLBACKS}


def int_setting(config: Mapping[str, Any], key: str, default: int) -> int:
    """``config[key]`` as an int (librdkafka takes numbers as strings too), else ``default``."""
    value = config.get(key)
    if value is None:
        return default
    try:
        return int(value)
    except (TypeError, ValueError):
        raise ValueError(f"librdkafka setting {key!r} must be an integer, got {value!r}") from None


_TRUE = frozenset({"true", "t", "1"})
_FALSE = frozenset({"false", "f", "0"})


def bool_setting(config: Mapping[str, Any], key: str, default: bool) -> bool:
    """``config[key]`` as librdkafka reads a boolean (``True``, ``"true"``, ``"t"``, ``"1"`` and
    their false forms, any case), else ``default``."""
    value = config.get(key)
    if value is None:
        return default
    if isinstance(value, bool):
        return value
    word = str(value).strip().lower()
    if word in _TRUE or word in _FALSE:
        return word in _TRUE
    raise ValueError(f"librdkafka setting {key!r} must be true or false, got {value!r}")


def message_limit(message_max_bytes: int, topic_max_message_bytes: int | None) -> int:
    """The largest message the sink may produce: the producer's ``message.max.bytes`` (librdkafka
    checks the UNCOMPRESSED size of key, value and headers against it when ``produce`` is called)
    and the topic's ``max.message.bytes`` (the broker checks each record batch), whichever is
    smaller."""
    if topic_max_message_bytes is None:
        return message_max_bytes
    return min(message_max_bytes, topic_max_message_bytes)
