"""Benchmark of ``kvevents route --serve``: requests/s and latency of ``POST /match`` under load.

    python bench/route_serve.py                     # stdlib, old-2w, uvicorn-2w: ~90 s on 2 cores
    python bench/route_serve.py --quick             # a smoke test
    python bench/route_serve.py --servers stdlib    # the old server alone

The index: 256 workers (64 instances x 4 attention-DP ranks), each holding prefixes of 24 of 512
64-block prompts (``bench/support/route_index.py``). Queries: held-out 64-block prompts sharing a
prefix with the corpus, as ``POST /match`` token ids (single), ``POST /match/hashes`` engine
hashes, and ``POST /match`` batches of 16 prompts; *tiny* (one unknown hash: almost no handler
work) shows what the HTTP stack itself costs on the machine at that moment.

Servers, side by side in one run, each in a child process serving the same index:

- **stdlib**: the threaded ``http.server`` this project served with before (the baseline,
  ``bench/support/stdlib_route_server.py``; tokens only, no batch form);
- **old-2w**: that server with the handlers it had before their fast path
  (``bench/support/route_old_app.py``), 2 worker processes;
- **uvicorn-1w / uvicorn-2w**: ``kvevents route --serve``'s server (uvicorn, httptools, uvloop,
  a bare ASGI app, the compiled fast path of ``_route_fast``) with 1 and 2 worker processes, a
  listening socket each (``SO_REUSEPORT``); **uvicorn-2w-shared**: 2 processes sharing one
  listening socket, as before (``--shared-socket``); **uvicorn-2w-asgi**: uvicorn-2w with every
  request through the ASGI app (``ServeOptions(direct=False)``, the path before the direct one);
  **uvicorn-2w-live**: uvicorn-2w with each
  process following an idle topic (a ``LiveIndex`` thread, as ``route --serve``; needs
  ``KAFKA_BOOTSTRAP_SERVERS``);
- **granian-2w**: the same handlers under granian's RSGI interface, 2 workers: a measurement-only
  prototype (``bench/support/route_granian.py``) to compare server stacks; not in the default run.

Load: ``wrk`` (Debian's package) on the same 2 cores, keep-alive connections. *max*: closed
loop, as fast as answers come; *half*: half the max rate of that server, held by pacing each
connection (a random 2-6 ms, mean 4, after each answer) and choosing the number of connections
by 1 s probes; the achieved rate is printed next to the target and a step more than 10% off is
flagged (and fails the goal). *5k*: the same pacing at 5,000 req/s, half the issue's 10,000
(single and hashes forms, on a server whose max reached 6,000). ``--repeats N`` runs each paced
step N times (the median p99 is shown, every repeat kept in the JSON). Per run (a paced step's
measured run only, not its probes or warm-up): each server process's share of the server CPU
(how evenly the connections were spread), server CPU per request, the time the server
processes' threads spent runnable but waiting for a core (``/proc/PID/task/*/schedstat``) per
request, and wrk's own CPU per request.

Side by side: ``--interleave`` starts every server first and takes turns between them run by
run (the paced repeats' order rotating), so servers are compared at the same moments of a
shared machine rather than minutes apart. ``--warmup``, ``--wrk-nice`` and ``--server-nice``
(each a list) set how paced runs are made: a warm-up at the paced rate before the measured run
(its p99 printed in brackets), wrk's and the servers' niceness; the settings take turns over the
repeats and each gets its own goal line. ``--forms single`` measures the goal's form alone. Every server's answer is first checked against the
in-process scoring. The goal's verdict reads the 5k step (the issue: "p99 <= 5 ms at half that
load", that load being 10,000 req/s); p99 at half the measured max is reported beside it.
Results: ``bench/results/route_serve.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing
import os
import platform
import signal
import statistics
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from support import route_index, route_procs, route_servers, wrk_load

from kvevents.commands._routing import score_prompt

RESULTS = Path(__file__).resolve().parent / "results" / "route_serve.json"
GOAL_PER_S = 10_000
GOAL_P99_US = 5_000
GOAL_HALF_PER_S = GOAL_PER_S // 2  # "p99 <= 5 ms at half that load"


DEFAULT = "stdlib,old-2w,uvicorn-2w"


def _in_process(work: route_index.Workload) -> dict[str, dict[str, float]]:
    """What the handlers cost per request without HTTP (decode, score, encode): the median over
    the queries of the least CPU time of 5 passes, old (before the fast path) and new."""
    from support.route_old_app import OldRouteApp

    from kvevents.commands._route_app import AppOptions, RouteApp, StaticSource

    options = AppOptions(block_size=route_index.BLOCK_SIZE)
    out: dict[str, dict[str, float]] = {}
    for name, app in (("old", OldRouteApp(StaticSource(work.index), options)),
                      ("new", RouteApp(StaticSource(work.index), options))):  # fmt: skip
        out[name] = {}
        for form, handler, bodies in (("single", app._match_tokens, work.single), ("hashes", app._match_hashes, work.hashes),
                                      ("batch", app._match_tokens, work.batch)):  # fmt: skip
            best = [float("inf")] * min(len(bodies), 100)
            for _ in range(5):
                for i, body in enumerate(bodies[: len(best)]):
                    t0 = time.process_time()
                    handler(body)
                    best[i] = min(best[i], time.process_time() - t0)
            out[name][form] = round(sorted(best)[len(best) // 2] * 1e6, 1)
    return out


def _post(url: str, body: bytes) -> dict[str, Any]:
    request = urllib.request.Request(url, body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as response:
        result: dict[str, Any] = json.loads(response.read())
        return result


def _check(name: str, url: str, work: route_index.Workload) -> None:
    """The server's best worker and scores equal the in-process ones (a few queries)."""
    for body in work.single[:20]:
        tokens = json.loads(body)["token_ids"]
        _, want = score_prompt(work.index, tokens, route_index.BLOCK_SIZE)
        got = _post(url + "/match", body)
        assert [s["matched_blocks"] for s in got["scores"]] == [s.matched_blocks for s in want], name
        assert [(s["instance_id"], s["attention_dp_rank"]) for s in got["scores"]] == [
            (s.instance_id, s.attention_dp_rank) for s in want
        ], name


def _wait_ready(url: str, timeout: float = 120.0) -> float:
    """Seconds until ``/readyz`` answered 200 four times in a row, each on a new connection (so
    on every process, most likely: a follower caught up with its topic, not still replaying)."""
    started = time.monotonic()
    in_a_row = 0
    while in_a_row < 4:
        try:
            with urllib.request.urlopen(url + "/readyz", timeout=2) as response:
                in_a_row = in_a_row + 1 if response.status == 200 else 0
        except OSError:
            in_a_row = 0
        if in_a_row < 4:
            if time.monotonic() - started > timeout:
                raise SystemExit(f"{url} not ready after {timeout:.0f} s")
            time.sleep(0.05 if in_a_row else 0.2)
    return time.monotonic() - started


def _get(conn: Any, path: str) -> bytes:
    conn.request("GET", path)
    response = conn.getresponse()
    body: bytes = response.read()
    return body


def _process_figures(url: str, want: int) -> dict[str, Any]:
    """Each server process's own figures from its ``/metrics`` (connections are opened until
    every process answered one): garbage collections by generation (count, total and longest
    pause, objects frozen) and the in-app time of ``/match`` and ``/match/hashes`` (the bucket
    bound holding 99% of the answers, and the share over 1 ms), over the whole run."""
    import http.client
    import re
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    out: dict[str, Any] = {}
    conns = []
    try:
        for _ in range(64):
            if len(out) >= want:
                break
            conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=10)
            conns.append(conn)
            pid = str(json.loads(_get(conn, "/healthz"))["pid"])
            if pid in out:
                continue
            figures: dict[str, Any] = {"gc": {}, "in_app": {}}
            buckets: dict[str, list[tuple[float, float]]] = {}
            for line in _get(conn, "/metrics").decode().splitlines():
                m = re.match(r'(kvevents_router_gc_\w+|kvevents_router_request_duration_seconds_bucket)'
                             r'\{([^}]*)\} (\S+)', line)  # fmt: skip
                if not m:
                    continue
                name, labels, value = (
                    m.group(1),
                    dict(re.findall(r'(\w+)="([^"]*)"', m.group(2))),
                    float(m.group(3)),
                )
                if name.startswith("kvevents_router_gc_"):
                    key = name.removeprefix("kvevents_router_gc_")
                    if "generation" in labels:
                        figures["gc"].setdefault(key, [0.0, 0.0, 0.0])[int(labels["generation"])] = value
                    else:
                        figures["gc"][key] = value
                elif labels.get("route") in ("/match", "/match/hashes") and labels.get("form") != "error":
                    le = float("inf") if labels["le"] == "+Inf" else float(labels["le"])
                    series = labels["route"] + (" batch" if labels.get("form") == "batch" else "")
                    buckets.setdefault(series, []).append((le, value))
            for route, cumulative in buckets.items():
                total = cumulative[-1][1]
                p99 = next(le for le, n in cumulative if n >= 0.99 * total)
                over_1ms = total - next(n for le, n in cumulative if le >= 0.001)
                figures["in_app"][route] = {"answers": int(total), "p99_bucket_ms": p99 * 1000,
                                            "over_1ms_share": round(over_1ms / total, 5) if total else None}  # fmt: skip
            out[pid] = figures
    finally:
        for conn in conns:
            conn.close()
    return out


@dataclass(frozen=True)
class Setting:
    """How a paced run is made, beyond its rate: a warm-up at the paced rate before the measured
    run (seconds), wrk's niceness, the server processes' niceness. Several settings given to
    ``--warmup``/``--wrk-nice``/``--server-nice`` take turns over the repeats (interleaved)."""

    warmup_s: float = 0.0
    wrk_nice: int = 0
    server_nice: int = 0

    @property
    def label(self) -> str:
        return f"warm-up {self.warmup_s:g} s, wrk nice {self.wrk_nice}, servers nice {self.server_nice}"

    @property
    def tag(self) -> str:
        return f"w{self.warmup_s:g}/n{self.wrk_nice}/s{self.server_nice}"


def _paced_once(pids: list[int], url: str, endpoint: str, bodies: list[bytes], rate: float, seconds: float,
                connections: int, setting: Setting) -> dict[str, Any]:  # fmt: skip
    """One paced run at ``rate`` with ``setting`` (servers reniced for the run only)."""
    load = partial(wrk_load.paced, url, endpoint, bodies, rate=rate, seconds=seconds, max_connections=connections,
                   warmup_s=setting.warmup_s, nice=setting.wrk_nice)  # fmt: skip
    if setting.server_nice:
        route_procs.renice(pids, setting.server_nice)
    try:
        run = route_procs.run_counted(pids, load, paced=True)
    finally:
        if setting.server_nice:
            route_procs.renice(pids, 0)
    run["setting"] = asdict(setting)
    return run


def _median_of_first(runs: list[dict[str, Any]], settings: list[Setting]) -> dict[str, Any]:
    """The run with the median p99 among the first setting's runs."""
    first = [r for r in runs if r["setting"] == asdict(settings[0])]
    return sorted(first, key=lambda r: r["p99_us"])[(len(first) - 1) // 2]


def _p99s(runs: list[dict[str, Any]]) -> str:
    """ " (repeats 3.10 4.20 ...)" in ms, or nothing for one run; with a warm-up, its own p99 in
    brackets before each (``[warm-up p99] measured p99``); with several settings, each tagged."""
    tagged = len({json.dumps(r.get("setting"), sort_keys=True) for r in runs}) > 1
    values = " ".join(
        (f"[{r['warmup']['p99_us'] / 1000:.2f}]" if r.get("warmup") else "")
        + format(r["p99_us"] / 1000, ".2f")
        + (f"@{Setting(**r['setting']).tag}" if tagged else "")
        for r in runs
    )
    return f" (repeats {values})" if len(runs) > 1 or runs[0].get("warmup") else ""


FORMS = ("single", "hashes", "batch", "tiny")


def _measure(servers: dict[str, tuple[str, list[int]]], work: route_index.Workload, seconds: float,
             connections: int, repeats: int = 1, settings: list[Setting] | None = None,
             only: tuple[str, ...] = FORMS) -> dict[str, dict[str, Any]]:  # fmt: skip
    """Each form on every server of ``servers`` (name: url, serving pids): the max runs, then the
    paced steps' repeats taking turns between the servers (the order rotating by repeat) and
    between the settings, so servers measured together see the same moments of the machine."""
    settings = settings or [Setting()]
    forms: dict[str, tuple[str, list[bytes]]] = {
        "single": ("/match", work.single),
        "hashes": ("/match/hashes", work.hashes),
        "batch": ("/match", work.batch),
        "tiny": ("/match/hashes", [b'{"block_hashes": [1]}']),  # the stack's own ceiling
    }
    out: dict[str, dict[str, Any]] = {name: {} for name in servers}
    for form, (endpoint, bodies) in forms.items():
        names = [n for n in servers if form in only and (form == "single" or n != "stdlib")]
        tops = {}
        for name in names:
            url, pids = servers[name]
            tops[name] = route_procs.run_counted(
                pids, partial(wrk_load.run, url, endpoint, bodies, connections=connections, seconds=seconds)
            )
        halves: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
        ats: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
        at_goal = [
            n
            for n in names
            if form in ("single", "hashes") and tops[n]["requests_per_s"] >= 1.2 * GOAL_HALF_PER_S
        ]
        half_rates = {n: tops[n]["requests_per_s"] / 2 for n in names}
        goal_rates = {n: float(GOAL_HALF_PER_S) for n in at_goal}
        for rates, runs in ((half_rates, halves), (goal_rates, ats)):
            turn = list(rates)
            for i in range(repeats if turn else 0):
                for name in turn[i % len(turn) :] + turn[: i % len(turn)]:
                    url, pids = servers[name]
                    runs[name].append(_paced_once(pids, url, endpoint, bodies, rates[name], seconds, connections,
                                                  settings[i % len(settings)]))  # fmt: skip
        for name in names:
            top = tops[name]
            half = _median_of_first(halves[name], settings)
            out[name][form] = {"max": top, "half": half, "half_repeats": halves[name]}
            goal_step = ""
            if ats[name]:
                at = _median_of_first(ats[name], settings)
                out[name][form]["at_goal_half"], out[name][form]["at_goal_half_repeats"] = at, ats[name]
                goal_step = (f" | at {at['requests_per_s']:>6,.0f} of {GOAL_HALF_PER_S:,} p99 {at['p99_us'] / 1000:5.2f} ms"
                             f"{_p99s(ats[name])}"
                             f" wait {at['server_runqueue_wait_us_per_request']:.0f} us/req"
                             f"{'' if all(r['on_target'] for r in ats[name]) else ' OFF TARGET'}")  # fmt: skip
            if form == "batch":
                out[name][form]["prompts_per_request"] = work.batch_size
            print(f"{name:<11} {form:<7} max {top['requests_per_s']:>9,.0f} req/s p50 {top['p50_us'] / 1000:6.2f} "
                  f"p99 {top['p99_us'] / 1000:6.2f} ms cpu {top['cpu_share_by_process']} "
                  f"{top['server_cpu_us_per_request']:.0f} us/req | at {half['requests_per_s']:>8,.0f} of "
                  f"{half['target_per_s']:,.0f} req/s ({half['connections']} conn) p50 {half['p50_us'] / 1000:5.2f} "
                  f"p99 {half['p99_us'] / 1000:5.2f} ms"
                  f"{_p99s(halves[name])}"
                  f" cpu {half['cpu_share_by_process']} {half['server_cpu_us_per_request']:.0f} us/req"
                  f" wait {half['server_runqueue_wait_us_per_request']:.0f} us/req wrk {half['wrk_cpu_us_per_request']:.0f} us/req"
                  f"{'' if all(r['on_target'] for r in halves[name]) else ' OFF TARGET'}{goal_step}"
                  f" errors {top['non2xx'] + top['read_errors'] + top['connect_errors'] + sum(r['non2xx'] for r in halves[name])}",
                  flush=True)  # fmt: skip
    return out


def _goal_of(top: dict[str, Any], ats: list[dict[str, Any]], halves: list[dict[str, Any]]) -> dict[str, Any]:
    at_p99 = statistics.median(a["p99_us"] for a in ats) if ats else None
    on_target = bool(ats) and all(a["on_target"] for a in ats)
    met = top["requests_per_s"] >= GOAL_PER_S and on_target and at_p99 is not None and at_p99 <= GOAL_P99_US
    return {"max_per_s": top["requests_per_s"],
            "at_goal_half_per_s": [a["requests_per_s"] for a in ats],
            "at_goal_half_p99_ms": [a["p99_us"] / 1000 for a in ats],
            "at_goal_half_warmup_p99_ms": [a["warmup"]["p99_us"] / 1000 for a in ats if a.get("warmup")],
            "at_goal_half_p99_ms_median": None if at_p99 is None else at_p99 / 1000,
            "at_goal_half_on_target": on_target,
            "half_of_max_per_s": [h["requests_per_s"] for h in halves],
            "half_of_max_target_per_s": halves[0]["target_per_s"],
            "half_of_max_p99_ms": [h["p99_us"] / 1000 for h in halves],
            "half_of_max_p99_ms_median": statistics.median(h["p99_us"] for h in halves) / 1000,
            "half_of_max_on_target": all(h["on_target"] for h in halves),
            "met": met}  # fmt: skip


def _goal(results: dict[str, Any], settings: list[Setting]) -> dict[str, Any]:
    """The issue's goal on single ``/match``: >= 10,000 req/s, and p99 <= 5 ms at half that load
    (5,000 req/s; the median of the repeats, every repeat on target). The p99 at half the
    measured max is reported beside it (a harder step when the max is above 10,000). With
    several settings, the figures of each (``by_setting``); the top level reads the first."""
    out = {}
    for name, r in results.items():
        top, halves = r["single"]["max"], r["single"]["half_repeats"]
        ats = r["single"].get("at_goal_half_repeats", [])
        by = []
        for setting in settings:
            pick = asdict(setting)
            one = _goal_of(
                top, [a for a in ats if a["setting"] == pick], [h for h in halves if h["setting"] == pick]
            )
            by.append({"setting": pick, "label": setting.label, **one})
        out[name] = {**by[0], "by_setting": by}
    return out


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


@contextlib.contextmanager
def _started(ctx: Any, name: str, work: route_index.Workload) -> Iterator[tuple[str, int]]:
    """Server ``name`` in a child process, ready and its answers checked: (url, child pid)."""
    target, extra = route_servers.SERVERS[name]
    ports = ctx.Queue()
    child = ctx.Process(target=target, args=(work.index, ports), kwargs=extra, daemon=False)
    child.start()
    try:
        url = f"http://127.0.0.1:{ports.get(timeout=60)}"
        for _ in range(100):  # every worker process listening
            try:
                urllib.request.urlopen(url + "/healthz", timeout=2).read()
                break
            except OSError:
                time.sleep(0.1)
        if name.startswith("uvicorn"):
            print(
                f"{name:<11} ready after {_wait_ready(url):.1f} s (/readyz 200 four times in a row)",
                flush=True,
            )
        _check(name, url, work)
        assert child.pid is not None
        yield url, child.pid
    finally:
        if child.pid is not None:
            os.kill(child.pid, signal.SIGTERM)
        child.join(15)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="small index, 1 s per run, no JSON written")
    parser.add_argument(
        "--servers", default=DEFAULT, help=f"subset of {','.join(route_servers.SERVERS)} (default: {DEFAULT})"
    )
    parser.add_argument("--seconds", type=float, default=4.0, help="per wrk run (default: 4)")
    parser.add_argument("--connections", type=int, default=64, help="keep-alive connections at max load")
    parser.add_argument("--workers", type=int, default=256, help="index workers (default: 256)")
    parser.add_argument("--repeats", type=int, default=1, help="runs of each paced step (default: 1)")
    parser.add_argument("--forms", default=",".join(FORMS), help=f"subset of {','.join(FORMS)} to measure "
                        "(single is always measured: the goal reads it)")  # fmt: skip
    parser.add_argument("--warmup", default="0", help="seconds of a warm-up run at the paced rate before each "
                        "measured paced run (its p99 printed in brackets); a list (0,5) takes turns over the repeats")  # fmt: skip
    parser.add_argument("--wrk-nice", default="0", help="wrk's niceness (e.g. 10: wrk yields the cores to the "
                        "servers, as a load generator on another machine would); a list takes turns")  # fmt: skip
    parser.add_argument("--server-nice", default="0", help="the server processes' niceness during the paced "
                        "runs (negative: ahead of everything else on the machine); a list takes turns")  # fmt: skip
    parser.add_argument("--interleave", action="store_true", help="start every server first, then take turns "
                        "between them run by run (each server's paced repeats beside the others', not minutes apart)")  # fmt: skip
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args()
    settings = [Setting(w, int(n), int(m)) for w in _floats(args.warmup) for n in _floats(args.wrk_nice)
                for m in _floats(args.server_nice)]  # fmt: skip
    if args.repeats < len(settings):
        parser.error(f"--repeats {args.repeats} is fewer than the {len(settings)} settings to take turns")
    only = tuple(f for f in FORMS if f in {x.strip() for x in args.forms.split(",")} | {"single"})
    if args.quick:
        args.seconds, args.workers = 1.0, 32
    names = [n.strip() for n in args.servers.split(",") if n.strip()]
    unknown = sorted(set(names) - set(route_servers.SERVERS))
    if unknown:
        parser.error(f"unknown server(s) {unknown}")
    load_start = os.getloadavg()
    work = route_index.build(workers=args.workers)
    print(f"index: {args.workers} workers, {work.index.held_blocks():,} held blocks; queries of "
          f"{work.blocks_per_prompt} blocks; load: wrk {args.connections} connections", file=sys.stderr)  # fmt: skip
    in_process = _in_process(work)
    print(f"in-process handler (no HTTP), p50 us: {in_process}", flush=True)
    print("paced runs: " + "; ".join(f"{s.label} ({s.tag})" for s in settings)
          + (" -- taking turns over the repeats" if len(settings) > 1 else ""), flush=True)  # fmt: skip
    ctx = multiprocessing.get_context("fork")
    results: dict[str, Any] = {}
    groups = [names] if args.interleave else [[n] for n in names]
    for group in groups:
        with contextlib.ExitStack() as stack:
            running = {name: stack.enter_context(_started(ctx, name, work)) for name in group}
            measured = _measure({n: (url, route_procs.server_pids(pid)) for n, (url, pid) in running.items()}, work,
                                args.seconds, args.connections, args.repeats, settings, only)  # fmt: skip
            for name, (url, pid) in running.items():
                results[name] = measured[name]
                if name.startswith("uvicorn"):
                    own = _process_figures(url, len(route_procs.server_pids(pid)))
                    results[name]["process_figures"] = own
                    print(f"{name:<11} per process (whole run): " + "; ".join(
                        f"pid {p}: gc {f['gc'].get('collections_total')} collections, longest "
                        f"{[round(x * 1000, 2) for x in f['gc'].get('pause_max_seconds', [])]} ms, "
                        f"{f['gc'].get('frozen_objects', 0):,.0f} frozen; in-app p99 <= "
                        + ", ".join(f"{r} {v['p99_bucket_ms']:g} ms ({v['over_1ms_share']:.2%} > 1 ms)"
                                    for r, v in f["in_app"].items())
                        for p, f in own.items()), flush=True)  # fmt: skip
                pss = route_procs.tree_pss_mb(pid)
                results[name]["memory_pss_mb"] = {"total": round(sum(pss.values()), 1), "by_process": pss}
                print(f"{name:<11} memory (PSS, every process): {sum(pss.values()):.1f} MB {pss}", flush=True)
    base = results.get("stdlib", {}).get("single", {}).get("max", {}).get("requests_per_s")
    ratios = {
        name: round(r["single"]["max"]["requests_per_s"] / base, 2) for name, r in results.items() if base
    }
    if ratios:
        print(f"single /match requests/s over stdlib: {ratios}")
    old = results.get("old-2w")
    over_old = {
        name: {form: round(r[form]["max"]["requests_per_s"] / old[form]["max"]["requests_per_s"], 2)
               for form in ("single", "hashes", "batch")}
        for name, r in results.items() if old and name not in ("stdlib", "old-2w")
    }  # fmt: skip
    if over_old:
        print(f"max requests/s over the old handlers (old-2w): {over_old}")
    goal = _goal(results, settings)
    for name, g in ((n, g) for n, whole in goal.items() for g in whole["by_setting"]):
        at = ("not run (max below 6,000)" if g["at_goal_half_p99_ms_median"] is None else
              f"p99 {g['at_goal_half_p99_ms_median']:.2f} ms at {GOAL_HALF_PER_S:,}"
              f" (repeats {' '.join(f'{v:.2f}' for v in g['at_goal_half_p99_ms'])})"
              f"{'' if g['at_goal_half_on_target'] else ' (off target)'}")  # fmt: skip
        print(f"goal (single /match >= {GOAL_PER_S:,} req/s, p99 <= {GOAL_P99_US / 1000:g} ms at {GOAL_HALF_PER_S:,}): "
              f"{name:<11} {g['max_per_s']:,.0f} req/s, {at}: {'MET' if g['met'] else 'not met'}; at half the "
              f"measured max ({g['half_of_max_target_per_s']:,.0f}) p99 {g['half_of_max_p99_ms_median']:.2f} ms"
              f" (repeats {' '.join(f'{v:.2f}' for v in g['half_of_max_p99_ms'])})"
              f"{'' if g['half_of_max_on_target'] else ' (off target)'}"
              + (f" [{g['label']}]" if len(settings) > 1 or g["setting"] != asdict(Setting()) else ""))  # fmt: skip
    print(f"load average: at start {load_start}, at end {os.getloadavg()}")
    if args.quick:
        return
    merged: dict[str, Any] = {}
    if args.output.exists():  # a run of some servers keeps the others' last figures
        merged = json.loads(args.output.read_text()).get("servers", {})
    merged.update(results)
    document = {
        "machine": {"python": platform.python_version(), "cpus": os.cpu_count(), "load_generator": "wrk (Debian)"},
        "index": {"workers": args.workers, "held_blocks": work.index.held_blocks(),
                  "blocks_per_prompt": work.blocks_per_prompt, "batch_size": work.batch_size},
        "settings": {"seconds": args.seconds, "connections": args.connections, "repeats": args.repeats,
                     "forms": list(only), "paced_settings": [asdict(s) for s in settings],
                     "paced": "half the max rate, and 5,000 req/s; mean delay 4 ms per connection (2-6), "
                              "connections by 1 s probes"},
        "goal": goal,
        "in_process_handler_p50_us": in_process,
        "load_average_at_start": load_start,
        "load_average_at_end": os.getloadavg(),
        "max_over_old_handlers": over_old,
        "servers": merged,
        "single_max_over_stdlib": ratios,
    }  # fmt: skip
    args.output.parent.mkdir(exist_ok=True)
    args.output.write_text(json.dumps(document, indent=1) + "\n")
    print(f"wrote {args.output}", file=sys.stderr)


if __name__ == "__main__":
    main()
