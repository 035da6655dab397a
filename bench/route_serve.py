"""Benchmark of ``kvevents route --serve``: what HTTP adds to a routing query.

    python bench/route_serve.py            # about a minute on 2 cores
    python bench/route_serve.py --quick    # a smoke test

An index is filled in memory from simulated engines (``EngineSimulator`` on real managers,
``--workers`` workers, shared system prompts and Zipf documents), then held-out requests of the
same workload are scored three ways, side by side:

- **in-process**: ``score_prompt`` (content hashes of the prompt + ``match_details`` + sort),
  the function the server runs under its lock (the baseline);
- **HTTP sequential**: one client, one keep-alive connection, ``POST /match`` (JSON encode,
  request, parse, score, JSON answer) to a ``MatchServer`` in a child process;
- **HTTP concurrent**: 1, 2 and 4 client threads (each with its own connection) for a fixed
  time: requests per second.

Every HTTP answer is checked against the in-process one. Timings repeat (``--repeat``), the best
p50 is reported; the machine is shared, so compare ratios within one run. Results:
``bench/results/route_serve.json``.
"""

from __future__ import annotations

import argparse
import http.client
import json
import multiprocessing
import platform
import statistics
import threading
import time
from pathlib import Path
from typing import Any

from kvevents.consumer import CacheIndex
from kvevents.producer import KVCacheEventManager
from kvevents.producer.simulator import EngineSimulator, SimulatorConfig
from kvevents.producer.simulator.workload import WorkloadConfig, WorkloadGenerator
from kvevents.schemas import EventBatch

from kvevents.commands._route_server import MatchServer
from kvevents.commands._routing import score_prompt

RESULTS = Path(__file__).resolve().parent / "results" / "route_serve.json"
BLOCK_SIZE = 32


def build_index(workers: int, iterations: int) -> tuple[CacheIndex, WorkloadConfig, int]:
    workload = WorkloadConfig(seed=11, request_rate=20.0)
    index = CacheIndex()
    events = 0
    for w in range(workers):
        name = f"engine-{w // 4}"
        rank = w % 4
        with KVCacheEventManager(1_000_000) as manager:
            sim = EngineSimulator(
                SimulatorConfig(
                    instance_id=name, attention_dp_rank=rank, block_size=BLOCK_SIZE, num_secondary_blocks=256
                ),
                manager,
                WorkloadGenerator(workload.for_worker(name, rank)),
            )
            sim.run(max_iterations=iterations)
            assert manager.settle(timeout=60)
            drain = manager.drain(timeout=0)
            events += len(drain.events)
            # one batch per worker; a real sink interleaves them, the index state is the same
            index.apply(EventBatch(name, drain.events, attention_dp_size=4, producer_id=w, sequence=0))
    return index, workload, events


def percentiles(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)
    return {
        "p50_us": round(ordered[len(ordered) // 2] * 1e6, 1),
        "p99_us": round(ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))] * 1e6, 1),
        "mean_us": round(statistics.fmean(ordered) * 1e6, 1),
    }


def serve(index_bytes: bytes, port_queue: Any, stop: Any) -> None:
    index = CacheIndex.from_bytes(index_bytes)
    server = MatchServer(("127.0.0.1", 0), index, threading.Lock(), None, BLOCK_SIZE)
    port_queue.put(server.server_address[1])
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True)
    thread.start()
    stop.wait()
    server.shutdown()
    server.server_close()


def post(conn: http.client.HTTPConnection, body: bytes) -> dict[str, Any]:
    conn.request("POST", "/match", body=body, headers={"Content-Type": "application/json"})
    response = conn.getresponse()
    data = response.read()
    assert response.status == 200, data
    return json.loads(data)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--workers", type=int, default=16)
    parser.add_argument("--iterations", type=int, default=1500)
    parser.add_argument("--queries", type=int, default=400)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=3.0, help="per concurrency level")
    args = parser.parse_args()
    if args.quick:
        args.workers, args.iterations, args.queries, args.repeat, args.seconds = 4, 200, 50, 1, 1.0

    started = time.monotonic()
    index, workload, events = build_index(args.workers, args.iterations)
    print(f"index: {args.workers} workers, {events:,} events, {index.held_blocks():,} held blocks "
          f"({time.monotonic() - started:.1f} s to simulate)")  # fmt: skip
    requests = WorkloadGenerator(workload).held_out(args.queries, seed=1)
    prompts = [(r.prompt.tolist(), r.lora_id) for r in requests]
    bodies = [
        json.dumps({"token_ids": t, "block_size": BLOCK_SIZE, "lora_id": lora}).encode()
        for t, lora in prompts
    ]
    expected = [[s.to_json() for s in score_prompt(index, t, BLOCK_SIZE, lora)[1]] for t, lora in prompts]
    blocks = statistics.fmean(len(t) // BLOCK_SIZE for t, _ in prompts)
    hit = sum(1 for e in expected if e) / len(expected)

    ctx = multiprocessing.get_context("fork")
    ports, stop = ctx.Queue(), ctx.Event()
    child = ctx.Process(target=serve, args=(index.to_bytes(), ports, stop), daemon=True)
    child.start()
    port = ports.get(timeout=60)

    inproc: list[dict[str, float]] = []
    sequential: list[dict[str, float]] = []
    for _ in range(args.repeat):
        samples = []
        for t, lora in prompts:
            t0 = time.perf_counter()
            score_prompt(index, t, BLOCK_SIZE, lora)
            samples.append(time.perf_counter() - t0)
        inproc.append(percentiles(samples))
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        samples = []
        for body, want in zip(bodies, expected, strict=True):
            t0 = time.perf_counter()
            answer = post(conn, body)
            samples.append(time.perf_counter() - t0)
            assert answer["scores"] == want, "the server's answer differs from the in-process one"
        conn.close()
        sequential.append(percentiles(samples))

    concurrent: dict[str, float] = {}
    for clients in (1, 2, 4):
        counts = [0] * clients
        deadline = time.monotonic() + args.seconds

        def client(
            i: int, deadline: float = deadline, counts: list[int] = counts, step: int = clients
        ) -> None:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
            n = i
            while time.monotonic() < deadline:
                post(conn, bodies[n % len(bodies)])
                counts[i] += 1
                n += step
            conn.close()

        threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
        t0 = time.monotonic()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        concurrent[str(clients)] = round(sum(counts) / (time.monotonic() - t0), 1)
    stop.set()
    child.join(10)

    best_in = min(inproc, key=lambda r: r["p50_us"])
    best_http = min(sequential, key=lambda r: r["p50_us"])
    result = {
        "machine": {
            "python": platform.python_version(),
            "cpus": multiprocessing.cpu_count(),
            "compiled_core": index.compiled,
        },
        "index": {"workers": args.workers, "events": events, "held_blocks": index.held_blocks()},
        "queries": {"count": len(prompts), "mean_blocks": round(blocks, 1), "with_a_hit": round(hit, 3)},
        "in_process": best_in,
        "http_sequential": best_http,
        "http_over_in_process_p50": round(best_http["p50_us"] / best_in["p50_us"], 1),
        "http_requests_per_s_by_clients": concurrent,
        "repeats": args.repeat,
    }
    print(f"{'':24} {'p50 us':>10} {'p99 us':>10}")
    print(f"{'in-process score_prompt':24} {best_in['p50_us']:>10} {best_in['p99_us']:>10}")
    print(f"{'HTTP POST /match':24} {best_http['p50_us']:>10} {best_http['p99_us']:>10}")
    print(
        f"HTTP / in-process p50: {result['http_over_in_process_p50']}x; requests/s by clients: {concurrent}"
    )
    if not args.quick:
        RESULTS.parent.mkdir(exist_ok=True)
        RESULTS.write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
