"""Drive an HTTP server with ``wrk`` (Debian's package: ``apt-get install wrk``): POST bodies
taken in turn from a file, keep-alive connections, closed loop (as fast as answers come) or
paced (each connection waits ``delay_ms`` between requests, to hold a lower load), and the
latency percentiles wrk measured, read back as JSON."""

from __future__ import annotations

import json
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

_SCRIPT = """
local bodies = {}
local i = 0
local endpoint = "/match"
function init(args)
  endpoint = args[2]
  for line in io.lines(args[1]) do bodies[#bodies + 1] = line end
  i = math.random(#bodies)
end
function request()
  i = i % #bodies + 1
  return wrk.format("POST", endpoint, {["Content-Type"] = "application/json"}, bodies[i])
end
%DELAY%
function done(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    'WRKJSON {"requests": %d, "duration_us": %d, "connect_errors": %d, "read_errors": %d, '
    .. '"write_errors": %d, "non2xx": %d, "timeouts": %d, "p50_us": %d, "p90_us": %d, '
    .. '"p99_us": %d, "max_us": %d}\\n',
    summary.requests, summary.duration, e.connect, e.read, e.write, e.status, e.timeout,
    latency:percentile(50), latency:percentile(90), latency:percentile(99), latency.max))
end
"""


def wrk_path() -> str:
    found = shutil.which("wrk")
    if found is None:
        raise SystemExit("wrk is not installed: apt-get install -y wrk")
    return found


def run(url: str, endpoint: str, bodies: list[bytes], *, connections: int, seconds: float,
        threads: int = 1, delay_ms: int = 0) -> dict[str, Any]:  # fmt: skip
    """One wrk run; the figures plus requests per second."""
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "bodies.txt"
        data.write_bytes(b"\n".join(bodies) + b"\n")
        script = Path(tmp) / "load.lua"
        delay = f"function delay() return {delay_ms} end" if delay_ms > 0 else ""
        script.write_text(_SCRIPT.replace("%DELAY%", delay))
        command = [wrk_path(), f"-t{threads}", f"-c{connections}", f"-d{max(1, round(seconds))}s", "--timeout", "5s",
                   "-s", str(script), url, "--", str(data), endpoint]  # fmt: skip
        out = subprocess.run(command, capture_output=True, text=True, timeout=seconds + 60, check=True)
    line = next((x for x in out.stdout.splitlines() if x.startswith("WRKJSON ")), None)
    if line is None:
        raise RuntimeError(f"wrk printed no figures: {out.stdout}\n{out.stderr}")
    result: dict[str, Any] = json.loads(line[len("WRKJSON ") :])
    result["requests_per_s"] = round(result["requests"] / (result["duration_us"] / 1e6), 1)
    result["connections"] = connections
    result["delay_ms"] = delay_ms
    return result
