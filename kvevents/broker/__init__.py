"""kvevents.broker: a local Apache Kafka broker from Maven Central's jars, no Docker needed.

``jars`` fetches Kafka's jars, ``config`` writes the KRaft configuration, ``process`` starts and
stops the JVM, ``probe`` asks a broker for metadata, ``bootstrap`` decides which Kafka a command
talks to. ``kvevents broker --help`` is the command line over this package.
"""

from .process import (
    FAST_START_JVM_OPTIONS,
    BrokerAlreadyRunning,
    BrokerError,
    BrokerStartError,
    BrokerStatus,
    LocalBroker,
    StopResult,
    default_state_dir,
    find_java,
)

__all__ = [
    "FAST_START_JVM_OPTIONS",
    "BrokerAlreadyRunning",
    "BrokerError",
    "BrokerStartError",
    "BrokerStatus",
    "LocalBroker",
    "StopResult",
    "default_state_dir",
    "find_java",
]
