"""compose.yaml's pipeline services: they wait for a healthy broker, reach it on the compose
network's listener, and run kvevents command lines that this checkout's CLI accepts."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import yaml

from kvevents.cli import build_parser

REPO = Path(__file__).resolve().parents[3]
COMPOSE = yaml.safe_load((REPO / "compose.yaml").read_text())


def kvevents_lines(service: str) -> list[list[str]]:
    """The ``kvevents ...`` argv of every line of a service's shell script (``$$VAR`` -> 1)."""
    script = COMPOSE["services"][service]["command"][-1]
    lines = []
    for line in script.splitlines():
        words = shlex.split(line.replace('"$$SIM_DURATION"', "1").replace('"$$SIM_RATE"', "1"))
        if "kvevents" in words:
            lines.append(words[words.index("kvevents") + 1 :])
    return lines


def test_pipeline_services_wait_for_a_healthy_broker_on_the_internal_listener():
    advertised = COMPOSE["services"]["kafka"]["environment"]["KAFKA_ADVERTISED_LISTENERS"]
    for name in ("simulator", "index"):
        service = COMPOSE["services"][name]
        assert service["depends_on"]["kafka"]["condition"] == "service_healthy"
        bootstrap = service["environment"]["KAFKA_BOOTSTRAP_SERVERS"]
        assert f"//{bootstrap}" in advertised
    # mpiexec forwards SIGINT to every rank (a clean stop); route --serve stops alike on SIGTERM.
    assert COMPOSE["services"]["simulator"]["stop_signal"] == "SIGINT"


def test_the_simulator_runs_4_ranks_under_mpiexec_with_arguments_the_cli_accepts():
    script = COMPOSE["services"]["simulator"]["command"][-1]
    assert "exec mpiexec -disable-auto-cleanup -n 4 kvevents simulate" in script
    parser = build_parser()
    commands = [parser.parse_args(argv) for argv in kvevents_lines("simulator")]
    assert [c.command for c in commands] == ["topic", "simulate"]
    assert commands[1].topic == commands[0].name == "kv-cache-events"


def test_the_index_service_serves_routing_on_its_published_port():
    service = COMPOSE["services"]["index"]
    (serve,) = [argv for argv in kvevents_lines("index") if argv[0] == "route"]
    assert serve[:2] == ["route", "--serve"] and "0.0.0.0" in serve
    port = serve[serve.index("--port") + 1]
    assert [published_port(p) for p in service["ports"]] == [("127.0.0.1", port, port)]
    parser = build_parser()
    registered = parser._subparsers._group_actions[0].choices  # type: ignore[union-attr]
    if "route" in registered:  # the route command lives on the CLI branch until it is merged
        args = parser.parse_args(serve)
        assert args.serve and args.port == int(port)


def published_port(spec: str) -> tuple[str, str, str]:
    """(host address, host port, container port) of a ``ports`` entry, defaults expanded."""
    expanded = re.sub(r"\$\{[A-Z_]+:-([^}]*)\}", r"\1", spec)
    address, host_port, container_port = expanded.rsplit(":", 2)
    return address, host_port, container_port


def test_every_published_port_binds_to_loopback_by_default():
    published = [p for service in COMPOSE["services"].values() for p in service.get("ports", [])]
    assert len(published) == 2
    for spec in published:
        assert published_port(spec)[0] == "127.0.0.1", spec
        assert "KVEVENTS_BIND_ADDRESS" in spec  # one documented switch to expose them
