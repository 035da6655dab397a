"""``kvevents registry start|status|stop`` as a user runs them: Apicurio comes up with its HTTP
and management ports bound to 127.0.0.1 only, answers the Confluent API, and stops."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

KVEVENTS = str(Path(sys.executable).with_name("kvevents"))


def _listening(port: int) -> set[str]:
    """Local addresses listening on ``port`` (from /proc/net/tcp and tcp6)."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            address, _, hex_port = local.rpartition(":")
            if state == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN
                found.add(address)
    return found


LOOPBACK = {"0100007F", "0000000000000000FFFF00000100007F"}  # 127.0.0.1, ::ffff:127.0.0.1


@pytest.mark.slow
def test_start_status_stop_bound_to_loopback(tmp_path: Path) -> None:
    state = tmp_path / "registry"

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([KVEVENTS, "registry", *args, "--data-dir", str(state)],
                              capture_output=True, text=True, timeout=180)  # fmt: skip

    started = run("start")
    try:
        assert started.returncode == 0, started.stderr
        assert "starting Apicurio Registry" in started.stderr
        status = run("status", "--json")
        assert status.returncode == 0
        info = json.loads(status.stdout)
        assert info["running"] and info["answers"] and info["url"].endswith("/apis/ccompat/v7")
        ports = json.loads((state / "registry.json").read_text())
        for port in (ports["port"], ports["management_port"]):
            assert _listening(port) and _listening(port) <= LOOPBACK, (port, _listening(port))
        assert run("status", "--url").stdout.strip() == info["url"]
    finally:
        stopped = run("stop")
    assert stopped.returncode == 0 and "registry stopped" in stopped.stdout
    assert run("status").returncode == 3
