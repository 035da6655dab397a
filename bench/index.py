"""Benchmark of the global cache index (issue 17): kvevents' CacheIndex side by side, in one run,
with NVIDIA Dynamo's RadixTree from Python (the anchor) and the naive pure-Python index
(block hash -> set of workers, fed decoded batches: ``support/index_naive.py``).

    python bench/index.py            # default: ~90 CPU-seconds (2-4 min on the busy 2-core VM)
    python bench/index.py --quick    # a smoke test (~15 CPU-seconds)
    python bench/index.py --full     # 256 x 100k blocks, 1M worker-blocks per matrix cell,
                                     # 600k-event realistic stream, 10M-event rebuilds (minutes)

Parts (``--parts``, all by default):

- matrix (``support/index_matrix.py``): a synthetic fleet (``support/index_fleet.py``) of 16,
  256 and 1,024 workers with the same total of worker-blocks each, a scale Dynamo and the naive
  index ingest in seconds; ingest alone, lookups alone (1, 64, 512 blocks), and 64-block lookups
  from a second thread while a thread ingests (on a schedule, ``--lookup-rate`` per second, latency
  from each lookup's scheduled time, so waiting for the GIL behind a batch counts); cross-checks;
- big (``support/index_big.py``): kvevents alone at 256 workers x ``--big-blocks-per-worker``
  (100k in ``--full``: 25.6M worker-blocks, the issue's scale; Dynamo and the naive index would
  take minutes there), in a child process: ingest, lookups during ingest, lookups, a worker's
  restart (a Created event: the writer's time, and the longest 64-block lookup meanwhile; with
  ``--baseline-core`` for both cores), RSS;
- realistic (``support/index_realistic.py``): the simulated fleet stream of
  ``support/index_stream.py``: ingest events/s and blocks/s against Dynamo and the naive
  index, find_matches on the final state, memory per worker-block in child processes, the
  in-memory rebuild, the state round trip, and (``--topic-events``) the Kafka rebuilds;
- growth (``support/index_growth.py``): 64-block lookups on a schedule while the index grows
  across table growths and a node-id bit (6M blocks, then 4M more), on this core and the
  ``--baseline-core``: what a rebuild costs the lookups.

``--freshness`` also runs ``bench/freshness.py``'s ``measure()`` (end-to-end freshness) when that
file exists. kvevents is fed with ``CacheIndex.apply_encoded_many`` when the class has it (the
output says which), else one ``apply_encoded`` per batch. Timings repeat (``--repeat``); the
figures are medians of the repeats, sides interleaved so the machine's noise hits them alike.

bench/results/index.json, top-level keys: ``command``, ``machine`` (with ``loadavg_start`` /
``loadavg_end``), ``core`` (compiled, ingest method, Dynamo version), ``targets`` (issue 17's
targets: measured, bound, PASS/FAIL, where measured), ``matrix`` (``cells[workers].sides[side]``:
``ingest``, ``lookups[size]``, ``during_ingest``; ``cross_check``; ``stream``), ``big_scale``
(``ingest``, ``during_ingest``, ``lookups``, ``worker_restart``, ``memory``), ``realistic`` (``ingest``,
``find_matches``, ``memory``, ``rebuild_in_memory``, ``state_round_trip``, ``rebuild_from_topic``,
``rebuild_from_checkpoint``), ``growth`` (``sides[core]``: ``median``, ``runs``), ``freshness``. Latencies are microseconds (``*_us``): lookups give
p50/p99/max/mean per pass, the median over passes, and ``p50_best_us`` / ``p99_best_us`` over each
query's fastest pass (the machine's scheduling noise stripped); ``during_ingest`` counts
``missed`` schedule slots. Rates are per second, sizes bytes.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import inspect
import json
import os
import platform
import shlex
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent / "support"))

import index_realistic as realistic
from index_big import run_big, run_big_ingest
from index_growth import print_growth, run_growth
from index_matrix import run_matrix
from index_report import compute_targets, print_big, print_matrix, print_realistic, print_targets
from index_sides import ingest_method, load_dynamo
from index_stream import StreamConfig
from kvevents.consumer.index import compiled_core_available

RESULTS = Path(__file__).resolve().parent / "results" / "index.json"
FRESHNESS = Path(__file__).resolve().parent / "freshness.py"
PARTS = ("matrix", "big", "realistic", "growth")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="small scales (smoke test)")
    p.add_argument("--full", action="store_true", help="the issue's scales (minutes)")
    p.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of {', '.join(PARTS)}")
    p.add_argument("--repeat", type=int, default=3, help="timing repetitions (medians reported)")
    p.add_argument(
        "--concurrent-repeat", type=int, default=2, help="repetitions of the lookups-during-ingest runs"
    )
    p.add_argument("--lookup-rate", type=float, default=2000.0, help="lookups/s scheduled during ingest")
    p.add_argument(
        "--cross-check", type=int, default=300, help="queries cross-checked against Dynamo and naive"
    )
    p.add_argument("--matrix-workers", default="16,256,1024", help="worker counts of the matrix")
    p.add_argument(
        "--matrix-worker-blocks", type=int, default=None, help="worker-blocks per cell (131072; full 1M)"
    )
    p.add_argument("--matrix-queries", type=int, default=300, help="queries per size per matrix cell")
    p.add_argument("--big-workers", type=int, default=256)
    p.add_argument("--big-blocks-per-worker", type=int, default=None, help="25k (full 100k, quick 4k)")
    p.add_argument(
        "--big-queries",
        type=int,
        default=5000,
        help="queries per size at the big scale (each pass's p99 is its 1%% slowest: 50 of 5,000)",
    )
    p.add_argument("--big-tail-instances", type=int, default=4, help="instances fed while lookups run")
    p.add_argument(
        "--baseline-core",
        default="",
        help="another build of the compiled core (a _indexcore*.so, e.g. main's): the big part's and the "
        "matrix's lookups also run on it, interleaved with the other sides (the matrix's side 'baseline')",
    )
    p.add_argument(
        "--growth-prefill",
        type=int,
        default=None,
        help="growth part: blocks in the index before the window (6M; quick 200k)",
    )
    p.add_argument(
        "--growth-window",
        type=int,
        default=None,
        help="growth part: blocks fed while lookups run (4M, crossing 2**23 node ids; quick 200k)",
    )
    p.add_argument(
        "--events", type=int, default=None, help="realistic stream events (60k; full 600k, quick 40k)"
    )
    p.add_argument("--queries", type=int, default=1000, help="realistic stream queries per size")
    p.add_argument(
        "--rebuild-events", type=int, default=None, help="in-memory rebuild events (0: skipped; full 10M)"
    )
    p.add_argument("--topic-events", type=int, default=None, help="Kafka topic rebuild events (0; full 10M)")
    p.add_argument("--topic-repeat", type=int, default=2, help="repetitions of the topic rebuild")
    p.add_argument("--freshness", action="store_true", help="also run bench/freshness.py's measure()")
    p.add_argument("--output", type=Path, default=RESULTS)
    p.add_argument(
        "--child",
        choices=[
            "memory-ours",
            "memory-ours-traced",
            "memory-dynamo",
            "memory-naive",
            "rebuild",
            "topic",
            "big",
            "big-ingest",
        ],
        help=argparse.SUPPRESS,
    )
    p.add_argument("--payload", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    scale = "full" if args.full else "quick" if args.quick else "default"
    defaults = {
        "matrix_worker_blocks": {"quick": 1 << 16, "default": 1 << 17, "full": 1 << 20},
        "big_blocks_per_worker": {"quick": 4_000, "default": 25_000, "full": 100_000},
        "events": {"quick": 40_000, "default": 60_000, "full": 600_000},
        "growth_prefill": {"quick": 200_000, "default": 6_000_000, "full": 6_000_000},
        "growth_window": {"quick": 200_000, "default": 4_000_000, "full": 4_000_000},
        "rebuild_events": {"quick": 0, "default": 0, "full": 10_000_000},
        "topic_events": {"quick": 0, "default": 0, "full": 10_000_000},
    }
    for key, by_scale in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, by_scale[scale])
    if args.quick:
        args.repeat = min(args.repeat, 2)
        args.concurrent_repeat = 1
        args.queries, args.matrix_queries, args.big_queries = 300, 200, 500
    args.scale = scale
    args.matrix_workers = [int(w) for w in args.matrix_workers.split(",") if w]
    args.parts = [x for x in args.parts.split(",") if x]
    unknown = set(args.parts) - set(PARTS)
    if unknown:
        p.error(f"unknown parts {sorted(unknown)}: choose from {', '.join(PARTS)}")
    return args


def run_child_mode(args: argparse.Namespace) -> dict[str, Any]:
    if args.child == "big":
        return run_big(
            args.big_workers,
            args.big_blocks_per_worker,
            args.big_queries,
            args.repeat,
            args.big_tail_instances,
            args.lookup_rate,
            args.baseline_core or None,
        )
    if args.child == "big-ingest":
        return run_big_ingest(args.big_workers, args.big_blocks_per_worker, args.big_tail_instances)
    if args.child == "rebuild":
        return realistic.rebuild_child(args.payload, args.rebuild_events)
    if args.child == "topic":
        return realistic.topic_child(
            args.payload, StreamConfig(target_events=args.events), args.topic_events, args.repeat
        )
    side = {"memory-dynamo": "dynamo", "memory-naive": "naive"}.get(args.child, "ours")
    return realistic.memory_child(side, args.payload, args.child == "memory-ours-traced")


def freshness(args: argparse.Namespace) -> dict[str, Any]:
    """``bench/freshness.py``'s ``measure()`` when that file exists."""
    if not FRESHNESS.exists():
        msg = "end-to-end freshness is measured by bench/freshness.py, which is not in this tree"
        print(msg)
        return {"status": msg}
    spec = importlib.util.spec_from_file_location("bench_freshness", FRESHNESS)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    kwargs = {}
    if "bootstrap" in inspect.signature(module.measure).parameters:
        kwargs["bootstrap"] = os.environ.get("KAFKA_BOOTSTRAP_SERVERS")
    result: dict[str, Any] = module.measure(**kwargs)
    if hasattr(module, "print_table"):
        module.print_table(result)
    return result


def dynamo_version() -> str | None:
    try:
        return importlib.metadata.version("ai-dynamo-runtime")
    except importlib.metadata.PackageNotFoundError:
        return None


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child:
        print(json.dumps(run_child_mode(args), default=str))
        return 0
    radix_tree = load_dynamo()
    if radix_tree is None:
        print(
            "!! NVIDIA Dynamo (pip install 'kvevents[bench-dynamo]') is not installed: no Dynamo baseline",
            file=sys.stderr,
        )
    if not compiled_core_available():
        print("!! kvevents.consumer._indexcore is not built: measuring the pure-Python core", file=sys.stderr)
    results: dict[str, Any] = {
        "benchmark": "index",
        "command": " ".join(shlex.quote(a) for a in [sys.executable, *sys.argv]),
        "scale": args.scale,
        "machine": {
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "loadavg_start": os.getloadavg(),
        },
        "core": {
            "compiled": compiled_core_available(),
            "ingest_method": ingest_method(),
            "dynamo_version": dynamo_version(),
        },
    }
    print(f"kvevents fed with CacheIndex.{ingest_method()}; Dynamo {dynamo_version() or 'not installed'}")
    started = time.perf_counter()
    if "matrix" in args.parts:
        print("matrix ...", flush=True)
        results["matrix"] = run_matrix(args, radix_tree)
    if "big" in args.parts:
        print(
            f"big scale: {args.big_workers} workers x {args.big_blocks_per_worker:,} blocks ...", flush=True
        )
        results["big_scale"] = realistic.run_child(
            [
                "--child",
                "big",
                *_forward(
                    args,
                    "big_workers",
                    "big_blocks_per_worker",
                    "big_queries",
                    "repeat",
                    "big_tail_instances",
                    "lookup_rate",
                    "baseline_core",
                ),
            ]
        )
        if compiled_core_available():
            # issue 17 (b) asks for ingest using both cores: the same instances fed with the
            # opt-in decoding thread (KVEVENTS_INGEST_THREADS=2, read at import: a child of its own)
            print("big scale, ingest with both cores (KVEVENTS_INGEST_THREADS=2) ...", flush=True)
            results["big_scale"]["ingest_both_cores"] = realistic.run_child(
                [
                    "--child",
                    "big-ingest",
                    *_forward(args, "big_workers", "big_blocks_per_worker", "big_tail_instances"),
                ],
                env={"KVEVENTS_INGEST_THREADS": "2"},
            )
    if "realistic" in args.parts:
        print("realistic stream ...", flush=True)
        t0 = time.perf_counter()
        results["realistic"] = realistic.run_realistic(args, radix_tree)
        print(f"  realistic stream: {time.perf_counter() - t0:.0f} s", flush=True)
    if "growth" in args.parts:
        print("growth: lookups while the tables grow ...", flush=True)
        results["growth"] = run_growth(
            args.growth_prefill,
            args.growth_window,
            args.lookup_rate,
            args.concurrent_repeat,
            args.baseline_core,
        )
    if args.freshness:
        results["freshness"] = freshness(args)
    results["machine"]["loadavg_end"] = os.getloadavg()
    results["seconds"] = time.perf_counter() - started
    results["targets"] = compute_targets(results)
    order = [
        "benchmark",
        "command",
        "scale",
        "machine",
        "core",
        "targets",
        "matrix",
        "big_scale",
        "realistic",
        "growth",
        "freshness",
        "seconds",
    ]
    results = {k: results[k] for k in order if k in results}
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(results, indent=2, default=str) + "\n")
    if "matrix" in results:
        print_matrix(results["matrix"])
    if "big_scale" in results:
        print_big(results["big_scale"])
        _print_baseline(results["big_scale"].get("baseline_core"))
    if "realistic" in results:
        print_realistic(results["realistic"])
    if "growth" in results:
        print_growth(results["growth"])
    print_targets(results["targets"])
    m = results["machine"]
    print(
        f"\nload average {m['loadavg_start'][0]:.2f} at the start, {m['loadavg_end'][0]:.2f} at the end; "
        f"{results['seconds']:.0f} s; wrote {args.output}"
    )
    return 0


def _print_baseline(base: dict[str, Any] | None) -> None:
    if not base:
        return
    print(f"  same process, interleaved, against the core in {base['core']}: ours / baseline")
    for size, r in base["ratios"].items():
        b = base["lookups"][size]
        print(
            f"    {size:>3} blocks: p50 {r['p50_us']:.2f}x, p99 {r['p99_us']:.2f}x (best pass p50 {r['p50_best_us']:.2f}x, "
            f"p99 {r['p99_best_us']:.2f}x); baseline p50 {b['p50_us']:.1f} us, p99 {b['p99_us']:.1f} us; "
            f"answers identical {r['identical_answers']}/{r['queries']}"
        )


def _forward(args: argparse.Namespace, *names: str) -> list[str]:
    out = []
    for name in names:
        out += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    return out


if __name__ == "__main__":
    sys.exit(main())
