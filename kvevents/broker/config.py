"""What a local single-node KRaft broker is made of on disk: paths, ports and config files.

Pure functions and small value types, no process handling (that is ``kvevents.broker``), so
that everything here is tested without a JVM. The state directory's layout:
``docs/OPERATIONS.md``.
"""

from __future__ import annotations

import base64
import json
import os
import socket
import uuid
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path

from .gclog import GC_LOG_NAME

__all__ = [
    "DEFAULT_HOST",
    "BrokerLayout",
    "BrokerPorts",
    "BrokerState",
    "choose_ports",
    "default_state_dir",
    "free_port",
    "new_cluster_id",
    "port_is_free",
    "render_log4j2_properties",
    "render_server_properties",
]

DEFAULT_HOST = "127.0.0.1"
"""Listeners bind to and advertise the loopback address unless told otherwise."""
NODE_ID = 1


def default_state_dir() -> Path:
    """Where ``kvevents broker`` keeps its broker: ``$KVEVENTS_BROKER_DIR``, else ``./.kvevents/broker``.

    One place, relative to the directory you run from (the repository root for ``make``), so
    that ``make demo``, ``make broker-stop`` and ``kvevents broker status`` find the same broker.
    """
    explicit = os.environ.get("KVEVENTS_BROKER_DIR")
    return Path(explicit).expanduser() if explicit else Path.cwd() / ".kvevents" / "broker"


@dataclass(frozen=True)
class BrokerLayout:
    """The files of one broker, all under ``state_dir``."""

    state_dir: Path

    @property
    def data_dir(self) -> Path:
        return self.state_dir / "data"

    @property
    def config_dir(self) -> Path:
        return self.state_dir / "config"

    @property
    def server_properties(self) -> Path:
        return self.config_dir / "server.properties"

    @property
    def log4j_properties(self) -> Path:
        return self.config_dir / "log4j2.properties"

    @property
    def log_file(self) -> Path:
        return self.state_dir / "broker.log"

    @property
    def gc_log(self) -> Path:
        return self.state_dir / GC_LOG_NAME

    @property
    def out_file(self) -> Path:
        return self.state_dir / "broker.out"

    @property
    def pid_file(self) -> Path:
        return self.state_dir / "broker.pid"

    @property
    def state_file(self) -> Path:
        return self.state_dir / "broker.json"

    @property
    def lock_file(self) -> Path:
        return self.state_dir / ".lock"

    @property
    def formatted(self) -> bool:
        """Whether ``kafka-storage format`` has run on the data directory."""
        return (self.data_dir / "meta.properties").is_file()

    def read_pid(self) -> int | None:
        """The pid in the pid file, or None when there is none or it is not a positive integer."""
        try:
            text = self.pid_file.read_text().strip()
        except OSError:
            return None
        return int(text) if text.isdigit() and int(text) > 0 else None

    def write_pid(self, pid: int) -> None:
        _write_atomically(self.pid_file, f"{pid}\n")

    def clear_pid(self) -> None:
        self.pid_file.unlink(missing_ok=True)


@dataclass(frozen=True)
class BrokerPorts:
    """The client (PLAINTEXT) and controller (KRaft) listener ports."""

    client: int
    controller: int

    def __post_init__(self) -> None:
        for name, port in (("client", self.client), ("controller", self.controller)):
            if not 0 < port < 65536:
                raise ValueError(f"{name} port {port} is not in 1..65535")
        if self.client == self.controller:
            raise ValueError(f"client and controller ports must differ (both are {self.client})")


@dataclass
class BrokerState:
    """What ``broker.json`` records about the latest start (the pid lives in ``broker.pid``)."""

    host: str
    client_port: int
    controller_port: int
    cluster_id: str
    kafka_version: str
    started_at: float = 0.0
    cds_pending: str | None = None
    """A class-data archive the JVM writes when it exits, to be moved into the cache."""

    @property
    def bootstrap_servers(self) -> str:
        return f"{self.host}:{self.client_port}"

    @property
    def ports(self) -> BrokerPorts:
        return BrokerPorts(self.client_port, self.controller_port)

    def save(self, layout: BrokerLayout) -> None:
        _write_atomically(layout.state_file, json.dumps(asdict(self), indent=1, sort_keys=True) + "\n")

    @classmethod
    def load(cls, layout: BrokerLayout) -> BrokerState | None:
        """The recorded state, or None when there is none or it cannot be read."""
        try:
            raw = json.loads(layout.state_file.read_text())
            return cls(**raw)
        except (OSError, ValueError, TypeError):
            return None


def _write_atomically(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    temporary.write_text(text)
    os.replace(temporary, path)


def port_is_free(host: str, port: int) -> bool:
    """Whether a listening socket can bind ``host:port`` now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError:
            return False
    return True


def free_port(host: str = DEFAULT_HOST, exclude: frozenset[int] = frozenset()) -> int:
    """A port the kernel says is free on ``host`` (racy by nature: the caller retries on a clash)."""
    for _ in range(50):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            probe.bind((host, 0))
            port = int(probe.getsockname()[1])
        if port not in exclude:
            return port
    raise OSError(f"no free port found on {host}")


def choose_ports(
    host: str = DEFAULT_HOST,
    client: int | None = None,
    controller: int | None = None,
    previous: BrokerPorts | None = None,
) -> BrokerPorts:
    """Ports for a start: the ones asked for, else the previous start's when free, else free ones.

    Reusing the previous ports keeps a restarted broker at the same bootstrap address.
    """

    def pick(asked: int | None, before: int | None, taken: frozenset[int]) -> int:
        if asked is not None:
            return asked
        if before is not None and before not in taken and port_is_free(host, before):
            return before
        return free_port(host, exclude=taken)

    client_port = pick(client, previous.client if previous else None, frozenset({controller or 0}))
    controller_port = pick(controller, previous.controller if previous else None, frozenset({client_port}))
    return BrokerPorts(client_port, controller_port)


def new_cluster_id() -> str:
    """A Kafka cluster id: a random 16-byte UUID in unpadded base64url, as ``random-uuid`` prints.

    Like Kafka's ``Uuid.randomUuid`` it never starts with ``-``: the storage tool's argument
    parser would take such an id for an option (1 id in 64 otherwise).
    """
    while True:
        cluster_id = base64.urlsafe_b64encode(uuid.uuid4().bytes).rstrip(b"=").decode("ascii")
        if not cluster_id.startswith("-"):
            return cluster_id


def _escape(value: str) -> str:
    """Escape a value for a Java properties file (backslashes and leading spaces)."""
    escaped = value.replace("\\", "\\\\").replace("\n", "\\n")
    return "\\ " + escaped[1:] if escaped.startswith(" ") else escaped


def render_server_properties(
    layout: BrokerLayout,
    ports: BrokerPorts,
    host: str = DEFAULT_HOST,
    extra: Mapping[str, str] | None = None,
    *,
    node_id: int = NODE_ID,
    quorum_voters: str | None = None,
) -> str:
    """``server.properties`` of a KRaft node (combined broker and controller): a single node by
    default, or one node of a cluster whose static ``quorum_voters`` (``id@host:port,...``)
    are given (see :mod:`kvevents.broker.cluster`).

    Internal topics get one partition (fewer partitions make the first consumer group and
    transaction start faster) and a replication factor of 1, or 3 with ``min.insync.replicas``
    2 in a cluster, and a consumer group rebalances at once. ``extra`` adds or overrides settings.
    """
    replicas, min_isr = ("1", "1") if quorum_voters is None else ("3", "2")
    quorum = (
        {"controller.quorum.bootstrap.servers": f"{host}:{ports.controller}"}
        if quorum_voters is None
        else {"controller.quorum.voters": quorum_voters}
    )
    settings: dict[str, str] = {
        "process.roles": "broker,controller",
        "node.id": str(node_id),
        **quorum,
        "listeners": f"PLAINTEXT://{host}:{ports.client},CONTROLLER://{host}:{ports.controller}",
        "advertised.listeners": f"PLAINTEXT://{host}:{ports.client},CONTROLLER://{host}:{ports.controller}",
        "listener.security.protocol.map": "PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT",
        "controller.listener.names": "CONTROLLER",
        "inter.broker.listener.name": "PLAINTEXT",
        "log.dirs": str(layout.data_dir),
        "num.partitions": "1",
        "default.replication.factor": replicas,
        "min.insync.replicas": min_isr,
        "offsets.topic.replication.factor": replicas,
        "offsets.topic.num.partitions": "1",
        "transaction.state.log.replication.factor": replicas,
        "transaction.state.log.min.isr": min_isr,
        "transaction.state.log.num.partitions": "1",
        "share.coordinator.state.topic.replication.factor": replicas,
        "share.coordinator.state.topic.min.isr": min_isr,
        "share.coordinator.state.topic.num.partitions": "1",
        "group.initial.rebalance.delay.ms": "0",
    }
    for key, value in (extra or {}).items():
        if not key or any(c in key for c in " =:\n"):
            raise ValueError(f"invalid broker property name {key!r}")
        settings[key] = str(value)
    lines = ["# Written by kvevents.broker; rewritten on every start."]
    lines += [f"{key}={_escape(value)}" for key, value in settings.items()]
    return "\n".join(lines) + "\n"


def render_log4j2_properties(log_file: Path, level: str = "INFO") -> str:
    """A log4j2 *properties* config (Kafka's jars read it; YAML would need more jars): one rolling file."""
    name = _escape(str(log_file))
    return "\n".join(
        [
            "status = warn",
            "appender.file.type = RollingFile",
            "appender.file.name = file",
            f"appender.file.fileName = {name}",
            f"appender.file.filePattern = {name}.%i",
            "appender.file.layout.type = PatternLayout",
            "appender.file.layout.pattern = [%d] %p %m (%c)%n",
            "appender.file.policies.type = Policies",
            "appender.file.policies.size.type = SizeBasedTriggeringPolicy",
            "appender.file.policies.size.size = 20MB",
            "appender.file.strategy.type = DefaultRolloverStrategy",
            "appender.file.strategy.max = 2",
            f"rootLogger.level = {level}",
            "rootLogger.appenderRef.file.ref = file",
            # The controller and request loggers are chatty at INFO and say nothing we need.
            "logger.request.name = kafka.request.logger",
            "logger.request.level = WARN",
            "logger.state.name = state.change.logger",
            "logger.state.level = WARN",
            "",
        ]
    )
