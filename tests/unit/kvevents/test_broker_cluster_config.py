"""The KRaft configuration of a cluster node (``kvevents broker start --nodes 3``): a static
quorum instead of the single node's bootstrap controller, replicated internal topics, and a
format without ``--standalone``; the CLI refuses single-node flags with ``--nodes``."""

from __future__ import annotations

from pathlib import Path

from kvevents.broker import LocalBroker
from kvevents.broker.cluster import LocalCluster, is_cluster_dir
from kvevents.broker.config import BrokerLayout, BrokerPorts, render_server_properties
from kvevents.cli import main


def properties(text: str) -> dict[str, str]:
    return dict(line.split("=", 1) for line in text.splitlines() if line and not line.startswith("#"))


def test_a_single_node_bootstraps_its_own_controller(tmp_path: Path) -> None:
    props = properties(render_server_properties(BrokerLayout(tmp_path), BrokerPorts(9092, 9093)))
    assert props["node.id"] == "1" and props["controller.quorum.bootstrap.servers"] == "127.0.0.1:9093"
    assert "controller.quorum.voters" not in props
    assert props["default.replication.factor"] == props["min.insync.replicas"] == "1"


def test_a_cluster_node_has_a_static_quorum_and_replicated_topics(tmp_path: Path) -> None:
    voters = "1@127.0.0.1:9093,2@127.0.0.1:9095,3@127.0.0.1:9097"
    text = render_server_properties(
        BrokerLayout(tmp_path), BrokerPorts(9094, 9095), node_id=2, quorum_voters=voters
    )
    props = properties(text)
    assert props["node.id"] == "2" and props["controller.quorum.voters"] == voters
    assert "controller.quorum.bootstrap.servers" not in props
    assert props["default.replication.factor"] == props["offsets.topic.replication.factor"] == "3"
    assert props["min.insync.replicas"] == props["transaction.state.log.min.isr"] == "2"


def test_a_cluster_gives_its_nodes_distinct_ports_one_cluster_id_and_remembers_them(tmp_path: Path) -> None:
    cluster = LocalCluster(tmp_path / "c", 3)
    ports = [(n.port, n.controller_port) for n in cluster.nodes]
    assert len({p for pair in ports for p in pair}) == 6
    assert [n.node_id for n in cluster.nodes] == [1, 2, 3]
    assert len({n.cluster_id for n in cluster.nodes}) == 1
    voters = cluster.nodes[0].quorum_voters
    assert voters == ",".join(f"{i}@127.0.0.1:{c}" for i, (_, c) in enumerate(ports, 1))
    assert cluster.bootstrap_servers == ",".join(f"127.0.0.1:{p}" for p, _ in ports)
    assert isinstance(cluster.node(2), LocalBroker) and cluster.node(2).node_id == 2
    assert not is_cluster_dir(tmp_path / "c")  # nothing written before a start


def test_the_cli_refuses_single_node_flags_with_nodes(capsys, tmp_path: Path) -> None:
    code = main(["broker", "start", "--nodes", "3", "--port", "9092", "--data-dir", str(tmp_path)])
    assert code == 2
    assert "--port" in capsys.readouterr().err
