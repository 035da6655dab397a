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
  listening socket, as before (``--shared-socket``); **uvicorn-2w-live**: uvicorn-2w with each
  process following an idle topic (a ``LiveIndex`` thread, as ``route --serve``; needs
  ``KAFKA_BOOTSTRAP_SERVERS``);
- **granian-2w**: the same handlers under granian's RSGI interface, 2 workers: a measurement-only
  prototype (``bench/support/route_granian.py``) to compare server stacks; not in the default run.

Load: ``wrk`` (Debian's package) on the same 2 cores, keep-alive connections. *max*: closed
loop, as fast as answers come; *half*: half the max rate of that server, held by pacing each
connection (a random 2-6 ms, mean 4, after each answer) and choosing the number of connections
by 1 s probes; the achieved rate is printed next to the target and a step more than 10% off is
flagged (and fails the goal). Per run: each server process's share of the server CPU (how evenly
the connections were spread) and server CPU per request. Every server's answer is first checked
against the in-process scoring. Results: ``bench/results/route_serve.json``.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import platform
import signal
import sys
import threading
import time
import urllib.request
from functools import partial
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from kvevents.consumer import CacheIndex
from support import route_index, wrk_load

from kvevents.commands._routing import score_prompt

RESULTS = Path(__file__).resolve().parent / "results" / "route_serve.json"
GOAL_PER_S = 10_000
GOAL_P99_US = 5_000


def _serve_stdlib(index: CacheIndex, port_queue: Any) -> None:
    from support.stdlib_route_server import MatchServer

    server = MatchServer(("127.0.0.1", 0), index, threading.Lock(), None, route_index.BLOCK_SIZE)
    server.handle_error = lambda request, address: None  # type: ignore[method-assign]  # wrk's resets
    port_queue.put(server.server_address[1])
    signal.signal(signal.SIGTERM, lambda *_: threading.Thread(target=server.shutdown).start())
    server.serve_forever(poll_interval=0.1)
    server.server_close()


def _serve_uvicorn(
    index: CacheIndex, port_queue: Any, workers: int, old: bool = False, shared: bool = False
) -> None:
    from support.route_old_app import OldRouteApp

    from kvevents.commands._route_app import RouteApp
    from kvevents.commands._route_http import ServeOptions, listen, serve_static

    options = ServeOptions(
        workers=workers, block_size=route_index.BLOCK_SIZE, access_log=False, reuse_port=not shared
    )
    socks = listen("127.0.0.1", 0, options)
    port_queue.put(socks[0].getsockname()[1])
    serve_static(index, socks, options, OldRouteApp if old else RouteApp)


def _serve_live(index: CacheIndex, port_queue: Any, workers: int) -> None:
    """uvicorn-2w with each process a ``LiveIndex`` following an idle topic of the broker in
    ``KAFKA_BOOTSTRAP_SERVERS`` (as ``route --serve`` does): what the follower thread costs."""
    from confluent_kafka.admin import AdminClient
    from kvevents.consumer import LiveIndex
    from kvevents.consumer.topics import TopicSpec, create_topic

    from kvevents.commands._route_http import ServeOptions, listen, serve

    bootstrap = os.environ.get("KAFKA_BOOTSTRAP_SERVERS")
    if not bootstrap:
        raise SystemExit("uvicorn-2w-live needs KAFKA_BOOTSTRAP_SERVERS (a broker to follow)")
    topic = f"bench-route-live-{os.getpid()}-{int(time.time())}"
    create_topic(bootstrap, TopicSpec(topic))
    options = ServeOptions(workers=workers, block_size=route_index.BLOCK_SIZE)
    socks = listen("127.0.0.1", 0, options)
    port_queue.put(socks[0].getsockname()[1])

    def follow(process: int) -> LiveIndex:
        live = LiveIndex(bootstrap, topic, index=index, offsets={0: 0})
        live.start()
        return live

    try:
        serve(socks, follow, options, on_exit=lambda process, source, signalled: source.close())  # type: ignore[attr-defined]
    finally:
        admin = AdminClient({"bootstrap.servers": bootstrap})  # kept: its futures need it alive
        admin.delete_topics([topic])[topic].result(30)


def _serve_granian(index: CacheIndex, port_queue: Any, workers: int) -> None:
    import socket
    import tempfile

    from granian import Granian  # a measurement-only prototype (see support/route_granian.py)

    with tempfile.NamedTemporaryFile(suffix=".index", delete=False) as f:
        f.write(index.to_bytes())
    os.environ["KVEVENTS_BENCH_INDEX"] = f.name
    os.environ["KVEVENTS_BENCH_BLOCK_SIZE"] = str(route_index.BLOCK_SIZE)
    with socket.socket() as probe:  # a free port (granian binds by number)
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    port_queue.put(port)
    server = Granian("support.route_granian:app", address="127.0.0.1", port=port, interface="rsgi",
                     workers=workers, log_enabled=False, backlog=2048,
                     working_dir=Path(__file__).resolve().parent)  # fmt: skip
    try:
        server.serve()
    finally:
        os.unlink(f.name)


SERVERS = {
    "stdlib": (_serve_stdlib, {}),
    "old-2w": (_serve_uvicorn, {"workers": 2, "old": True}),
    "uvicorn-1w": (_serve_uvicorn, {"workers": 1}),
    "uvicorn-2w": (_serve_uvicorn, {"workers": 2}),
    "uvicorn-2w-shared": (_serve_uvicorn, {"workers": 2, "shared": True}),
    "uvicorn-2w-live": (_serve_live, {"workers": 2}),
    "granian-2w": (_serve_granian, {"workers": 2}),
}
DEFAULT = "stdlib,old-2w,uvicorn-2w"


def _tree_pss_mb(pid: int) -> dict[str, float]:
    """Proportional set size (shared pages split between sharers) of a process and its children."""
    out: dict[str, float] = {}
    todo = [pid]
    while todo:
        p = todo.pop()
        try:
            text = Path(f"/proc/{p}/smaps_rollup").read_text()
            pss = next(int(line.split()[1]) for line in text.splitlines() if line.startswith("Pss:"))
            out[str(p)] = round(pss / 1024, 1)
            for task in Path(f"/proc/{p}/task").iterdir():
                todo += [int(c) for c in (task / "children").read_text().split()]
        except (OSError, StopIteration):
            continue
    return out


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


def _server_pids(pid: int) -> list[int]:
    """The processes that serve (the child itself with one worker, else its worker processes)."""
    kids = [
        int(c)
        for task in Path(f"/proc/{pid}/task").iterdir()
        for c in (task / "children").read_text().split()
    ]
    return kids or [pid]


def _cpu_s(pids: list[int]) -> list[float]:
    """User + system CPU seconds of each process so far."""
    out = []
    for p in pids:
        fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
        out.append((int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK"))
    return out


def _run_counted(pids: list[int], load: Any) -> dict[str, Any]:
    """``load()``'s wrk figures plus each server process's share of the CPU the run took and the
    server CPU per request (a process that takes most of it took most of the connections)."""
    before = _cpu_s(pids)
    result: dict[str, Any] = load()
    used = [a - b for a, b in zip(_cpu_s(pids), before, strict=True)]
    total = sum(used)
    result["cpu_share_by_process"] = [round(u / total, 2) if total else None for u in used]
    result["server_cpu_us_per_request"] = round(total / max(1, result["requests"]) * 1e6, 1)
    return result


def _measure(
    name: str, url: str, work: route_index.Workload, seconds: float, connections: int, pids: list[int]
) -> dict[str, Any]:
    forms: dict[str, tuple[str, list[bytes]]] = {"single": ("/match", work.single)}
    if name != "stdlib":
        forms["hashes"] = ("/match/hashes", work.hashes)
        forms["batch"] = ("/match", work.batch)
        forms["tiny"] = ("/match/hashes", [b'{"block_hashes": [1]}'])  # the stack's own ceiling
    out: dict[str, Any] = {}
    for form, (endpoint, bodies) in forms.items():
        top = _run_counted(
            pids, partial(wrk_load.run, url, endpoint, bodies, connections=connections, seconds=seconds)
        )
        half = _run_counted(pids, partial(wrk_load.paced, url, endpoint, bodies, rate=top["requests_per_s"] / 2,
                                          seconds=seconds, max_connections=connections))  # fmt: skip
        out[form] = {"max": top, "half": half}
        if form == "batch":
            out[form]["prompts_per_request"] = work.batch_size
        print(f"{name:<11} {form:<7} max {top['requests_per_s']:>9,.0f} req/s p50 {top['p50_us'] / 1000:6.2f} "
              f"p99 {top['p99_us'] / 1000:6.2f} ms cpu {top['cpu_share_by_process']} "
              f"{top['server_cpu_us_per_request']:.0f} us/req | at {half['requests_per_s']:>8,.0f} of "
              f"{half['target_per_s']:,.0f} req/s ({half['connections']} conn) p50 {half['p50_us'] / 1000:5.2f} "
              f"p99 {half['p99_us'] / 1000:5.2f} ms cpu {half['cpu_share_by_process']}"
              f"{'' if half['on_target'] else ' OFF TARGET'}"
              f" errors {top['non2xx'] + top['read_errors'] + top['connect_errors'] + half['non2xx']}",
              flush=True)  # fmt: skip
    return out


def _goal(results: dict[str, Any]) -> dict[str, Any]:
    """The issue's goal on single ``/match``: >= 10,000 req/s, and p99 <= 5 ms at the paced half
    step (which must have held its target rate)."""
    out = {}
    for name, r in results.items():
        top, half = r["single"]["max"], r["single"]["half"]
        met = top["requests_per_s"] >= GOAL_PER_S and half["on_target"] and half["p99_us"] <= GOAL_P99_US
        out[name] = {"max_per_s": top["requests_per_s"], "half_per_s": half["requests_per_s"],
                     "half_p99_ms": half["p99_us"] / 1000, "half_on_target": half["on_target"], "met": met}  # fmt: skip
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="small index, 1 s per run, no JSON written")
    parser.add_argument(
        "--servers", default=DEFAULT, help=f"subset of {','.join(SERVERS)} (default: {DEFAULT})"
    )
    parser.add_argument("--seconds", type=float, default=4.0, help="per wrk run (default: 4)")
    parser.add_argument("--connections", type=int, default=64, help="keep-alive connections at max load")
    parser.add_argument("--workers", type=int, default=256, help="index workers (default: 256)")
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args()
    if args.quick:
        args.seconds, args.workers = 1.0, 32
    names = [n.strip() for n in args.servers.split(",") if n.strip()]
    unknown = sorted(set(names) - set(SERVERS))
    if unknown:
        parser.error(f"unknown server(s) {unknown}")
    load_start = os.getloadavg()
    work = route_index.build(workers=args.workers)
    print(f"index: {args.workers} workers, {work.index.held_blocks():,} held blocks; queries of "
          f"{work.blocks_per_prompt} blocks; load: wrk {args.connections} connections", file=sys.stderr)  # fmt: skip
    in_process = _in_process(work)
    print(f"in-process handler (no HTTP), p50 us: {in_process}", flush=True)
    ctx = multiprocessing.get_context("fork")
    results: dict[str, Any] = {}
    for name in names:
        target, extra = SERVERS[name]
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
            _check(name, url, work)
            assert child.pid is not None
            results[name] = _measure(name, url, work, args.seconds, args.connections, _server_pids(child.pid))
            pss = _tree_pss_mb(child.pid)
            results[name]["memory_pss_mb"] = {"total": round(sum(pss.values()), 1), "by_process": pss}
            print(f"{name:<11} memory (PSS, every process): {sum(pss.values()):.1f} MB {pss}", flush=True)
        finally:
            if child.pid is not None:
                os.kill(child.pid, signal.SIGTERM)
            child.join(15)
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
    goal = _goal(results)
    for name, g in goal.items():
        print(f"goal (single /match >= {GOAL_PER_S:,} req/s, p99 <= {GOAL_P99_US / 1000:g} ms at half): {name:<11} "
              f"{g['max_per_s']:,.0f} req/s, p99 {g['half_p99_ms']:.2f} ms at {g['half_per_s']:,.0f}"
              f"{'' if g['half_on_target'] else ' (off target)'}: {'MET' if g['met'] else 'not met'}")  # fmt: skip
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
        "settings": {"seconds": args.seconds, "connections": args.connections,
                     "paced": "half the max rate; mean delay 4 ms per connection (2-6), connections by 1 s probes"},
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
