"""Which Kafka to talk to: an explicit address, ``KAFKA_BOOTSTRAP_SERVERS``, or the local broker."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["BOOTSTRAP_ENV", "NoBrokerConfigured", "resolve_bootstrap_servers"]

BOOTSTRAP_ENV = "KAFKA_BOOTSTRAP_SERVERS"


class NoBrokerConfigured(RuntimeError):
    """No address given, none in the environment, and no local broker running."""


def resolve_bootstrap_servers(explicit: str | None = None, state_dir: Path | None = None) -> str:
    """The bootstrap servers to use, in this order: ``explicit``, ``$KAFKA_BOOTSTRAP_SERVERS``,
    the running local broker of ``state_dir`` (default: ``kvevents broker``'s state directory)."""
    if explicit:
        return explicit
    from_env = os.environ.get(BOOTSTRAP_ENV, "").strip()
    if from_env:
        return from_env
    from .process import LocalBroker

    status = LocalBroker(state_dir).status()
    if status.running and status.bootstrap_servers:
        return status.bootstrap_servers
    raise NoBrokerConfigured(
        f"no Kafka address: pass --bootstrap-servers, set {BOOTSTRAP_ENV}, or start a local broker "
        f"with 'kvevents broker start' (none is running in {status.state_dir})"
    )
