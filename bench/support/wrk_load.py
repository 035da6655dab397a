"""Drive an HTTP server with ``wrk`` (Debian's package: ``apt-get install wrk``): POST bodies
taken in turn from a file, keep-alive connections, closed loop (as fast as answers come) or
paced (each connection waits a random whole number of milliseconds averaging ``delay_ms``
between requests), and the latency percentiles wrk measured, read back as JSON. :func:`paced`
holds a target rate: a fixed mean delay, and the number of connections found by short probes."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

_SCRIPT = """
local requests = {}
local i = 0
function init(args)
  -- each request formatted once: formatting a 12 KB body per request cost wrk ~6 us of the
  -- CPU it shares with the server
  for line in io.lines(args[1]) do
    requests[#requests + 1] = wrk.format("POST", args[2], {["Content-Type"] = "application/json"}, line)
  end
  i = math.random(#requests)
end
function request()
  i = i % #requests + 1
  return requests[i]
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
        threads: int = 1, delay_ms: int = 0, nice: int = 0) -> dict[str, Any]:  # fmt: skip
    """One wrk run; the figures plus requests per second. ``nice``: wrk's niceness (above 0:
    wrk yields the cores to the servers when both are runnable, as a load generator on another
    machine would; a stated setting of the run, not a default)."""
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "bodies.txt"
        data.write_bytes(b"\n".join(bodies) + b"\n")
        script = Path(tmp) / "load.lua"
        # wrk's delay() is in whole ms; a random spread around the mean keeps the connections
        # from firing in step (they all start together)
        spread = min(delay_ms - 1, max(2, delay_ms // 2))
        delay = (
            f"function delay() return math.random({delay_ms - spread}, {delay_ms + spread}) end"
            if delay_ms > 0
            else ""
        )
        script.write_text(_SCRIPT.replace("%DELAY%", delay))
        command = [wrk_path(), f"-t{threads}", f"-c{connections}", f"-d{max(1, round(seconds))}s", "--timeout", "5s",
                   "-s", str(script), url, "--", str(data), endpoint]  # fmt: skip
        out = subprocess.run(command, capture_output=True, text=True, timeout=seconds + 60, check=True,
                             preexec_fn=(lambda: os.nice(nice)) if nice else None)  # fmt: skip
    line = next((x for x in out.stdout.splitlines() if x.startswith("WRKJSON ")), None)
    if line is None:
        raise RuntimeError(f"wrk printed no figures: {out.stdout}\n{out.stderr}")
    result: dict[str, Any] = json.loads(line[len("WRKJSON ") :])
    result["requests_per_s"] = round(result["requests"] / (result["duration_us"] / 1e6), 1)
    result["connections"] = connections
    result["delay_ms"] = delay_ms
    result["wrk_nice"] = nice
    return result


def paced(url: str, endpoint: str, bodies: list[bytes], *, rate: float, seconds: float, delay_ms: int = 4,
          tolerance: float = 0.1, probes: int = 3, max_connections: int = 64, warmup_s: float = 0.0,
          nice: int = 0, on_measure: Callable[[], None] | None = None) -> dict[str, Any]:  # fmt: skip
    """A run at about ``rate`` requests/s: each connection sends one request, waits ``delay_ms``
    on average after the answer (longer for a rate under ~4 connections' worth), and so on; the number of connections is chosen by probes of
    1 s (each scales it by target / achieved, at most ``max_connections``: a server that needs
    more to reach the rate is saturated). The result adds ``target_per_s`` and ``on_target``
    (achieved within ``tolerance`` of the target). ``warmup_s`` > 0: a run of that many seconds at
    the chosen connections between the probes and the measured run, its figures kept apart
    (``warmup``: rate and p99), so the measured run starts on a server already at that rate.
    ``on_measure`` is called just before the measured run (to count its CPU alone)."""
    delay_ms = max(delay_ms, round(4000 / rate - 1.5))  # a low rate: at least 4 connections, waiting longer
    connections = min(max_connections, max(1, round(rate * (delay_ms + 1.5) / 1000)))  # 1.5 ms: answer, timer
    for _ in range(probes):
        probe = run(url, endpoint, bodies, connections=connections, seconds=1, delay_ms=delay_ms, nice=nice)
        ratio = probe["requests_per_s"] / rate
        if abs(ratio - 1) <= tolerance / 2:
            break
        connections = min(max_connections, max(1, round(connections / max(ratio, 0.05))))
    warmup = None
    if warmup_s > 0:
        warm = run(
            url, endpoint, bodies, connections=connections, seconds=warmup_s, delay_ms=delay_ms, nice=nice
        )
        warmup = {"seconds": max(1, round(warmup_s)), "requests_per_s": warm["requests_per_s"],
                  "p50_us": warm["p50_us"], "p99_us": warm["p99_us"]}  # fmt: skip
    if on_measure is not None:
        on_measure()
    result = run(
        url, endpoint, bodies, connections=connections, seconds=seconds, delay_ms=delay_ms, nice=nice
    )
    result["warmup"] = warmup
    result["target_per_s"] = round(rate, 1)
    result["on_target"] = abs(result["requests_per_s"] / rate - 1) <= tolerance
    return result
