"""librdkafka settings from a file named by ``$KVEVENTS_KAFKA_CONFIG``: how credentials reach
the CLI without appearing on a command line (``ps``) or in shell history.

The file has ``key=value`` lines (librdkafka property names, as kcat's ``-F`` file); blank
lines and lines starting with ``#`` are skipped. ``-X key=value`` flags win over it. Values are
never echoed: an error names the file and the line number only.
"""

from __future__ import annotations

import os
from pathlib import Path

from ._common import CommandError

ENV = "KVEVENTS_KAFKA_CONFIG"


def read_kafka_config_file(path: Path) -> dict[str, str]:
    """The settings of one file (``CommandError`` naming the file and line when it is bad)."""
    try:
        text = path.read_text()
    except OSError as exc:
        raise CommandError(
            f"cannot read the Kafka config file {path} (${ENV}): {exc.strerror or exc}"
        ) from None
    config: dict[str, str] = {}
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        key, sep, value = line.partition("=")
        if not sep or not key.strip():
            raise CommandError(f"{path} line {number}: expected key=value (${ENV})")
        config[key.strip()] = value.strip()
    return config


def kafka_config_from_env() -> dict[str, str]:
    """The settings of ``$KVEVENTS_KAFKA_CONFIG`` (empty when it is not set)."""
    name = os.environ.get(ENV, "").strip()
    return read_kafka_config_file(Path(name)) if name else {}
