"""A local KRaft cluster of N nodes (combined broker and controller each), from the same jars.

``LocalCluster(state_dir, nodes=3)`` runs N :class:`~kvevents.broker.LocalBroker` nodes in
``state_dir/node-1 .. node-N`` with one cluster id and a static controller quorum
(``controller.quorum.voters``): topics default to replication factor 3 and
``min.insync.replicas`` 2, so a cluster of 3 loses no acknowledged write when one node dies.
The nodes start together (none answers before a quorum is up) and each remembers its ports,
so a node restarted alone (``node(i).start()``) rejoins. ``kvevents broker start --nodes 3``
is the command line over it.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping
from pathlib import Path
from types import TracebackType

from .config import DEFAULT_HOST, BrokerState, free_port, new_cluster_id
from .process import BrokerError, BrokerStatus, LocalBroker, StopResult, _read_cluster_id

__all__ = ["LocalCluster", "is_cluster_dir"]


def is_cluster_dir(state_dir: Path) -> bool:
    """Whether ``state_dir`` holds a cluster's nodes (``node-1/`` ...)."""
    return (state_dir / "node-1").is_dir()


class LocalCluster:
    """N local KRaft nodes; a context manager that starts and stops them all."""

    def __init__(
        self,
        state_dir: str | os.PathLike[str],
        nodes: int = 3,
        *,
        host: str = DEFAULT_HOST,
        start_timeout: float = 120.0,
        stop_timeout: float = 20.0,
        heap: str | None = "384m",
        extra_properties: Mapping[str, str] | None = None,
        stop_with_parent: bool = False,
    ) -> None:
        if nodes < 2:
            raise ValueError(f"a cluster needs at least 2 nodes (use LocalBroker for one), got {nodes}")
        self.state_dir = Path(state_dir)
        existing = sorted(self.state_dir.glob("node-*"))
        if existing and len(existing) != nodes:
            raise BrokerError(f"{self.state_dir} holds a cluster of {len(existing)} nodes, not {nodes}")
        self.stop_with_parent = stop_with_parent
        self._release = threading.Event()
        ports = self._ports(nodes, host)
        voters = ",".join(f"{i}@{host}:{controller}" for i, (_, controller) in enumerate(ports, 1))
        cluster_id = _read_cluster_id(LocalBroker(self.state_dir / "node-1").layout) or new_cluster_id()
        self.nodes = [
            LocalBroker(
                self.state_dir / f"node-{i}",
                port=client,
                controller_port=controller,
                host=host,
                start_timeout=start_timeout,
                stop_timeout=stop_timeout,
                heap=heap,
                extra_properties=extra_properties,
                node_id=i,
                quorum_voters=voters,
                cluster_id=cluster_id,
                stop_with_parent=stop_with_parent,
            )
            for i, (client, controller) in enumerate(ports, 1)
        ]

    def _ports(self, nodes: int, host: str) -> list[tuple[int, int]]:
        """Each node's (client, controller) ports: the remembered ones, else free ones."""
        ports: list[tuple[int, int]] = []
        taken: set[int] = set()
        for i in range(1, nodes + 1):
            layout = LocalBroker(self.state_dir / f"node-{i}").layout
            state = BrokerState.load(layout)
            if state is not None:
                pair = (state.client_port, state.controller_port)
            else:
                client = free_port(host, frozenset(taken))
                pair = (client, free_port(host, frozenset(taken | {client})))
            taken.update(pair)
            ports.append(pair)
        return ports

    def node(self, node_id: int) -> LocalBroker:
        """Node ``node_id`` (1-based, its Kafka ``node.id``)."""
        return self.nodes[node_id - 1]

    @property
    def bootstrap_servers(self) -> str:
        """Every node's client address, comma-separated."""
        return ",".join(f"{n.host}:{n.port}" for n in self.nodes)

    def start(self) -> list[BrokerStatus]:
        """Start every node that is not running, together; return when each answers.

        Each node starts on a thread of its own, which then stays (parked) until :meth:`stop`:
        with ``stop_with_parent`` the kernel stops a JVM when the *thread* that started it ends.
        """
        results: dict[int, BrokerStatus | BaseException] = {}
        started = threading.Semaphore(0)

        def start(index: int, node: LocalBroker) -> None:
            try:
                results[index] = node.start()
            except BaseException as exc:  # noqa: BLE001 - re-raised below by the caller
                results[index] = exc
            started.release()
            if self.stop_with_parent:
                self._release.wait()

        pending = [(i, n) for i, n in enumerate(self.nodes) if n.status().pid is None]
        self._release.clear()
        for i, node in pending:
            threading.Thread(target=start, args=(i, node), name=f"kvevents-node-{i + 1}", daemon=True).start()
        for _ in pending:
            started.acquire()
        failures = [r for r in results.values() if isinstance(r, BaseException)]
        if failures:
            raise failures[0]
        return self.status()

    def stop(self, timeout: float | None = None) -> list[StopResult]:
        """Stop every node at once (SIGTERM, then SIGKILL after ``timeout``): one after another,
        the last nodes would wait for a controller quorum that is already gone."""
        results: dict[int, StopResult | BaseException] = {}

        def stop(index: int, node: LocalBroker) -> None:
            try:
                results[index] = node.stop(timeout)
            except BaseException as exc:  # noqa: BLE001 - re-raised below
                results[index] = exc

        threads = [threading.Thread(target=stop, args=(i, n)) for i, n in enumerate(self.nodes)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        self._release.set()
        failures = [r for r in results.values() if isinstance(r, BaseException)]
        if failures:
            raise failures[0]
        return [r for _, r in sorted(results.items()) if isinstance(r, StopResult)]

    def status(self, probe: bool = False) -> list[BrokerStatus]:
        return [node.status(probe) for node in self.nodes]

    def __enter__(self) -> LocalCluster:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.stop()
