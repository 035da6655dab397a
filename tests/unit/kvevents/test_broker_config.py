"""Broker config generation, ports and state files: no JVM needed."""

from __future__ import annotations

import base64
import socket
from pathlib import Path

import pytest

from kvevents.broker.config import (
    BrokerLayout,
    BrokerPorts,
    BrokerState,
    choose_ports,
    default_state_dir,
    free_port,
    new_cluster_id,
    port_is_free,
    render_log4j2_properties,
    render_server_properties,
)


def parse_properties(text: str) -> dict[str, str]:
    pairs = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        key, sep, value = line.partition("=")
        assert sep, f"not a key=value line: {line!r}"
        pairs[key.strip()] = value.strip()
    return pairs


def test_server_properties_describe_a_single_node_kraft_broker(tmp_path: Path) -> None:
    layout = BrokerLayout(tmp_path / "b")
    props = parse_properties(render_server_properties(layout, BrokerPorts(19092, 19093), host="127.0.0.1"))
    assert props["process.roles"] == "broker,controller"
    assert props["node.id"] == "1"
    assert props["controller.quorum.bootstrap.servers"] == "127.0.0.1:19093"
    assert props["listeners"] == "PLAINTEXT://127.0.0.1:19092,CONTROLLER://127.0.0.1:19093"
    assert "PLAINTEXT://127.0.0.1:19092" in props["advertised.listeners"]
    assert props["controller.listener.names"] == "CONTROLLER"
    assert props["log.dirs"] == str(tmp_path / "b" / "data")
    for key in (
        "offsets.topic.replication.factor",
        "transaction.state.log.replication.factor",
        "transaction.state.log.min.isr",
        "share.coordinator.state.topic.replication.factor",
        "share.coordinator.state.topic.min.isr",
    ):
        assert props[key] == "1", key
    assert props["group.initial.rebalance.delay.ms"] == "0"


def test_extra_properties_add_and_override(tmp_path: Path) -> None:
    layout = BrokerLayout(tmp_path)
    text = render_server_properties(
        layout, BrokerPorts(1000, 1001), extra={"message.max.bytes": "8388608", "num.partitions": "4"}
    )
    props = parse_properties(text)
    assert props["message.max.bytes"] == "8388608"
    assert props["num.partitions"] == "4"
    assert text.count("\nnum.partitions=") == 1


@pytest.mark.parametrize("bad", ["", "a b", "a=b", "x:y", "new\nline"])
def test_invalid_extra_property_names_are_rejected(tmp_path: Path, bad: str) -> None:
    with pytest.raises(ValueError, match="invalid broker property name"):
        render_server_properties(BrokerLayout(tmp_path), BrokerPorts(1000, 1001), extra={bad: "1"})


def test_backslashes_in_paths_are_escaped(tmp_path: Path) -> None:
    layout = BrokerLayout(tmp_path / "odd\\dir")
    text = render_server_properties(layout, BrokerPorts(1000, 1001))
    assert f"log.dirs={tmp_path}/odd\\\\dir/data" in text


def test_log4j2_config_logs_to_the_given_file(tmp_path: Path) -> None:
    text = render_log4j2_properties(tmp_path / "broker.log", level="DEBUG")
    props = parse_properties(text)
    assert props["appender.file.fileName"] == str(tmp_path / "broker.log")
    assert props["rootLogger.level"] == "DEBUG"
    assert props["rootLogger.appenderRef.file.ref"] == props["appender.file.name"]


@pytest.mark.parametrize(("client", "controller"), [(0, 1), (1, 65536), (5, 5)])
def test_bad_ports_are_rejected(client: int, controller: int) -> None:
    with pytest.raises(ValueError):
        BrokerPorts(client, controller)


def test_free_port_is_bindable_and_respects_exclusions() -> None:
    port = free_port()
    assert port_is_free("127.0.0.1", port)
    assert free_port(exclude=frozenset({port})) != port


def test_port_is_free_sees_a_listening_socket() -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        assert not port_is_free("127.0.0.1", held.getsockname()[1])


def test_choose_ports_takes_asked_ports_as_given() -> None:
    assert choose_ports(client=12345, controller=12346) == BrokerPorts(12345, 12346)


def test_choose_ports_reuses_the_previous_ports_when_free() -> None:
    client = free_port()
    previous = BrokerPorts(client, free_port(exclude=frozenset({client})))
    assert choose_ports(previous=previous) == previous


def test_choose_ports_avoids_a_previous_port_now_taken() -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        taken = held.getsockname()[1]
        ports = choose_ports(previous=BrokerPorts(taken, free_port(exclude=frozenset({taken}))))
    assert ports.client != taken
    assert ports.client != ports.controller


def test_choose_ports_never_gives_the_asked_port_twice() -> None:
    ports = choose_ports(client=free_port())
    assert ports.controller != ports.client


def test_cluster_ids_are_16_random_bytes_in_base64url() -> None:
    ids = {new_cluster_id() for _ in range(2000)}
    assert len(ids) == 2000
    for cluster_id in ids:
        assert len(cluster_id) == 22 and "=" not in cluster_id
        assert len(base64.urlsafe_b64decode(cluster_id + "==")) == 16
        # kafka-storage's parser reads "-t -abc..." as two options (1 random id in 64 starts so).
        assert not cluster_id.startswith("-")


def test_pid_file_round_trip_and_garbage(tmp_path: Path) -> None:
    layout = BrokerLayout(tmp_path)
    assert layout.read_pid() is None
    layout.write_pid(4242)
    assert layout.read_pid() == 4242
    for garbage in ("", "abc", "-5", "0", "12 13"):
        layout.pid_file.write_text(garbage)
        assert layout.read_pid() is None, garbage
    layout.clear_pid()
    layout.clear_pid()  # twice is fine
    assert not layout.pid_file.exists()


def test_state_file_round_trip_and_corruption(tmp_path: Path) -> None:
    layout = BrokerLayout(tmp_path)
    assert BrokerState.load(layout) is None
    state = BrokerState("127.0.0.1", 9092, 9093, new_cluster_id(), "4.1.1", started_at=1.5)
    state.save(layout)
    loaded = BrokerState.load(layout)
    assert loaded == state
    assert loaded is not None and loaded.bootstrap_servers == "127.0.0.1:9092"
    assert loaded.ports == BrokerPorts(9092, 9093)
    layout.state_file.write_text("{not json")
    assert BrokerState.load(layout) is None
    layout.state_file.write_text('{"host": "x"}')
    assert BrokerState.load(layout) is None


def test_layout_knows_whether_storage_is_formatted(tmp_path: Path) -> None:
    layout = BrokerLayout(tmp_path)
    assert not layout.formatted
    layout.data_dir.mkdir()
    (layout.data_dir / "meta.properties").write_text("cluster.id=x\n")
    assert layout.formatted


def test_default_state_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("KVEVENTS_BROKER_DIR", raising=False)
    monkeypatch.chdir(tmp_path)
    assert default_state_dir() == tmp_path / ".kvevents" / "broker"
    monkeypatch.setenv("KVEVENTS_BROKER_DIR", str(tmp_path / "elsewhere"))
    assert default_state_dir() == tmp_path / "elsewhere"
