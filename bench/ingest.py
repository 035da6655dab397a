"""Ingest from Avro bytes (issue 17 b): kvevents' compiled core fed with ``apply_encoded_many``,
decoding in a second thread (``KVEVENTS_INGEST_THREADS=2``) and in the writer thread (``=1``,
the default), side by side in one run with a baseline build (``--baseline-python``: another
checkout's interpreter, e.g. main's ``.venv/bin/python``) and the naive pure-Python index (fed
already-decoded batches, ``support/index_naive.py``). ``--baseline-core`` takes another build's
compiled core (a copy of its ``consumer/_indexcore*.so``) instead, loaded beside this one: its
sides run with this checkout's everything else, and an *interleaved* comparison feeds this
build's index and the baseline's the same batches in turn, one batch at a time (rotating which
goes first; one thread, each call's thread CPU time summed), so both see the same machine
noise at millisecond grain: the figure to trust on a busy machine.

    python bench/ingest.py                     # 256 workers x 10k blocks, 60k-event stream, 3 repeats
    python bench/ingest.py --quick             # a smoke test
    python bench/ingest.py --baseline-python /work/main/.venv/bin/python
    python bench/ingest.py --baseline-core /tmp/main/_indexcore.cpython-311-x86_64-linux-gnu.so

Two streams, generated once and kept in a temporary folder: the synthetic fleet of
``support/index_fleet.py`` (Stored and Removed events, 114 bytes of Avro per block) and the
realistic stream of ``support/index_stream.py`` (Created, Stored, Removed, Updated). Every
measurement runs in a fresh child process (its own heap and caches), the sides interleaved
repeat by repeat so the machine's noise hits them alike; figures are medians. Also, for this
build: the decoding thread's work alone (the flat reader, limits and salts, and the content
hashes it computes ahead; no index) per block; and for every kvevents side, 64-block lookups
from a second thread during the fleet's last 4 instances' ingest (latency from each lookup's
scheduled time, against the mean time to apply one batch).

bench/results/ingest.json: ``command``, ``loadavg_start`` / ``loadavg_end``, ``config``,
``sides[name]`` (``fleet`` and ``realistic``: ``blocks_per_s``, ``blocks_per_cpu_s``, the
repeats), ``decode`` (ns per block), ``during_ingest[name]``, ``ratios``, and with
``--baseline-core`` ``interleaved`` (per stream: CPU ns per block of each build per repeat, and
the ratio baseline / this build of their sums).
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent / "support"))

RESULTS = Path(__file__).resolve().parent / "results" / "ingest.json"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="small streams, 2 repeats (smoke test)")
    p.add_argument("--workers", type=int, default=256)
    p.add_argument("--blocks-per-worker", type=int, default=None, help="fleet blocks per worker (10k)")
    p.add_argument("--events", type=int, default=None, help="realistic stream events (60k)")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--baseline-python", default=None, help="interpreter of the baseline build")
    p.add_argument(
        "--baseline-core", default=None, help="another build's consumer/_indexcore*.so, run beside this one"
    )
    p.add_argument("--no-naive", action="store_true", help="leave the naive index out")
    p.add_argument("--lookup-rate", type=float, default=2000.0, help="lookups/s during ingest")
    p.add_argument("--output", type=Path, default=RESULTS)
    p.add_argument(
        "--child", choices=["ours", "naive", "decode", "during", "interleaved"], help=argparse.SUPPRESS
    )
    p.add_argument("--data", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--core", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.blocks_per_worker is None:
        args.blocks_per_worker = 2_000 if args.quick else 10_000
    if args.events is None:
        args.events = 20_000 if args.quick else 60_000
    if args.quick:
        args.repeat = min(args.repeat, 2)
    return args


# ------------------------------------------------------------------ streams


def write_streams(args: argparse.Namespace, folder: Path) -> dict[str, Any]:
    from index_fleet import Fleet, FleetConfig
    from index_stream import StreamConfig, generate
    from kvevents.schemas import encode_batch

    config = FleetConfig(workers=args.workers, blocks_per_worker=args.blocks_per_worker)
    fleet = Fleet(config)
    parts, fleet_blocks, fleet_bytes = [], 0, 0
    for i in range(config.instances):
        part = fleet.instance(i, sample_paths=8)
        parts.append((part.batches, part.paths, part.blocks_stored))
        fleet_blocks += part.blocks_stored
        fleet_bytes += sum(len(b) for b in part.batches)
    with open(folder / "fleet.pkl", "wb") as f:
        pickle.dump(parts, f, protocol=5)
    del parts
    stream = generate(StreamConfig(target_events=args.events))
    encoded = [encode_batch(b) for b in stream.batches]
    with open(folder / "realistic.pkl", "wb") as f:
        pickle.dump((encoded, stream.blocks_stored), f, protocol=5)
    return {
        "fleet": {
            "workers": args.workers,
            "blocks_per_worker": args.blocks_per_worker,
            "blocks_stored": fleet_blocks,
            "avro_bytes_per_block": fleet_bytes / fleet_blocks,
        },
        "realistic": {
            "events": stream.events,
            "blocks_stored": stream.blocks_stored,
            "avro_bytes_per_block": sum(len(b) for b in encoded) / stream.blocks_stored,
        },
    }


# ------------------------------------------------------------------ children


def _timed(feed: Any, *a: Any) -> tuple[float, float]:
    import gc

    gc.collect()
    cpu, start = time.process_time(), time.perf_counter()
    feed(*a)
    return time.perf_counter() - start, time.process_time() - cpu


def _new_index(core: str | None) -> Any:
    """A ``CacheIndex`` on this build's core, or on the compiled core at ``core`` (a path)."""
    from index_sides import index_with_core, load_core
    from kvevents.consumer import CacheIndex

    return CacheIndex() if core is None else index_with_core(load_core(core))


def child_ours(data: Path, core: str | None = None) -> dict[str, Any]:
    with open(data / "fleet.pkl", "rb") as f:
        parts = pickle.load(f)
    index = _new_index(core)
    batches = [b for batches, _, _ in parts for b in batches]
    blocks = sum(n for _, _, n in parts)
    wall, cpu = _timed(index.apply_encoded_many, batches)
    del batches, parts, index
    with open(data / "realistic.pkl", "rb") as f:
        encoded, rblocks = pickle.load(f)
    index = _new_index(core)
    rwall, rcpu = _timed(index.apply_encoded_many, encoded)
    return {
        "fleet": {"seconds": wall, "cpu_seconds": cpu, "blocks": blocks},
        "realistic": {"seconds": rwall, "cpu_seconds": rcpu, "blocks": rblocks},
    }


def child_naive(data: Path) -> dict[str, Any]:
    from index_naive import NaiveIndex
    from kvevents.schemas import decode_batch

    with open(data / "realistic.pkl", "rb") as f:
        encoded, rblocks = pickle.load(f)
    decoded = [decode_batch(b) for b in encoded]
    del encoded
    index = NaiveIndex()
    rwall, rcpu = _timed(index.apply_all, decoded)
    return {"realistic": {"seconds": rwall, "cpu_seconds": rcpu, "blocks": rblocks}}


def _fleet(data: Path) -> tuple[list[Any], list[bytes], int]:
    with open(data / "fleet.pkl", "rb") as f:
        parts = pickle.load(f)
    return parts, [b for batches, _, _ in parts for b in batches], sum(n for _, _, n in parts)


def child_interleaved(data: Path, core: str, repeat: int) -> dict[str, Any]:
    """This build and the core at ``core`` fed the same batches in turn, one at a time (one
    thread: KVEVENTS_INGEST_THREADS=1 in this child's environment); the first of each pair
    alternates. Each ``apply_encoded`` call's thread CPU time is summed per build."""
    import gc

    from kvevents.consumer import CacheIndex

    _, fleet, fleet_blocks = _fleet(data)
    with open(data / "realistic.pkl", "rb") as f:
        realistic, realistic_blocks = pickle.load(f)
    out: dict[str, Any] = {}
    clock = time.thread_time
    for stream, batches, blocks in (
        ("fleet", fleet, fleet_blocks),
        ("realistic", realistic, realistic_blocks),
    ):
        ours_ns, base_ns = [], []
        for r in range(repeat):
            indexes = [CacheIndex(), _new_index(core)]
            applies = [x.apply_encoded for x in indexes]
            spent = [0.0, 0.0]
            gc.collect()
            gc.disable()
            try:
                for j, batch in enumerate(batches):
                    for k in (0, 1) if (j + r) % 2 == 0 else (1, 0):
                        t0 = clock()
                        applies[k](batch)
                        spent[k] += clock() - t0
            finally:
                gc.enable()
            if indexes[0].to_bytes() != indexes[1].to_bytes():
                raise SystemExit(f"{stream}: this build and the baseline core built different indexes")
            ours_ns.append(spent[0] / blocks * 1e9)
            base_ns.append(spent[1] / blocks * 1e9)
            del indexes, applies
        out[stream] = {
            "ours_ns_per_block": ours_ns,
            "baseline_ns_per_block": base_ns,
            "baseline_over_ours": sum(base_ns) / sum(ours_ns),
        }
    return out


def child_decode(data: Path) -> dict[str, Any]:
    """This build: what the decoding thread does per block, alone (no index)."""
    from kvevents.consumer import _indexcore

    _, batches, blocks = _fleet(data)
    out: dict[str, Any] = {}
    for name, ahead in (("decode", False), ("decode_and_content_ahead", True)):
        best = float("inf")
        for _ in range(3):
            start = time.thread_time()
            _indexcore._decode_only(batches, ahead)
            best = min(best, time.thread_time() - start)
        out[f"{name}_ns_per_block"] = best / blocks * 1e9
    return out


def child_during(data: Path, lookup_rate: float, core: str | None = None) -> dict[str, Any]:
    """64-block lookups from a second thread while the fleet's last 4 instances are ingested."""
    from index_fleet import make_fleet_queries
    from index_sides import lookups_during_ingest, make_sides

    parts, _, _ = _fleet(data)
    tail = 4
    index = _new_index(core)
    index.apply_encoded_many([b for batches, _, _ in parts[:-tail] for b in batches])
    items = [b for batches, _, _ in parts[-tail:] for b in batches]
    paths = [p for _, ps, _ in parts for p in ps]
    side = make_sides(None)[0]
    side.new = lambda: index
    during = lookups_during_ingest(side, [], items, make_fleet_queries(paths, 64, 2000, seed=64), lookup_rate)
    during["batch_apply_us_mean"] = during["ingest_s"] / len(items) * 1e6
    return during


def run_child(python: str, mode: str, data: Path, env: dict[str, str], extra: list[str]) -> dict[str, Any]:
    cmd = [python, __file__, "--child", mode, "--data", str(data), *extra]
    out = subprocess.run(cmd, env={**os.environ, **env}, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise SystemExit(f"{shlex.join(cmd)} failed:\n{out.stderr}")
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


# ------------------------------------------------------------------ parent


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for stream in runs[0]:
        rows = [r[stream] for r in runs]
        blocks = rows[0]["blocks"]
        out[stream] = {
            "blocks": blocks,
            "blocks_per_s": statistics.median(blocks / r["seconds"] for r in rows),
            "blocks_per_cpu_s": statistics.median(blocks / r["cpu_seconds"] for r in rows),
            "repeats_blocks_per_s": [blocks / r["seconds"] for r in rows],
        }
    return out


def _median_during(rows: list[dict[str, Any]]) -> dict[str, float]:
    keys = ("p50_us", "p99_us", "max_us", "batch_apply_us_mean", "lookups", "missed")
    return {k: statistics.median(float(r[k]) for r in rows) for k in keys}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child:
        if args.child == "ours":
            result = child_ours(args.data, args.core)
        elif args.child == "interleaved":
            result = child_interleaved(args.data, args.core, args.repeat)
        elif args.child == "naive":
            result = child_naive(args.data)
        elif args.child == "decode":
            result = child_decode(args.data)
        else:
            result = child_during(args.data, args.lookup_rate, args.core)
        print(json.dumps(result))
        return 0
    load_start = os.getloadavg()
    sides: list[tuple[str, str, dict[str, str], str, list[str]]] = [
        ("kvevents (2 threads)", sys.executable, {"KVEVENTS_INGEST_THREADS": "2"}, "ours", []),
        ("kvevents (1 thread)", sys.executable, {"KVEVENTS_INGEST_THREADS": "1"}, "ours", []),
    ]
    base_core = ["--core", str(Path(args.baseline_core).resolve())] if args.baseline_core else []
    if base_core:
        for name, threads in (("baseline core (2 threads)", "2"), ("baseline core (1 thread)", "1")):
            sides.append((name, sys.executable, {"KVEVENTS_INGEST_THREADS": threads}, "ours", base_core))
    if args.baseline_python:
        # PYTHONDONTWRITEBYTECODE: the baseline checkout is read, never written
        sides.append(("baseline build", args.baseline_python, {"PYTHONDONTWRITEBYTECODE": "1"}, "ours", []))
    if not args.no_naive:
        sides.append(("naive (decoded)", sys.executable, {}, "naive", []))
    with tempfile.TemporaryDirectory(prefix="kvevents-ingest-") as tmp:
        data = Path(tmp)
        t0 = time.perf_counter()
        config = write_streams(args, data)
        print(f"streams written in {time.perf_counter() - t0:.1f} s: {json.dumps(config)}", flush=True)
        runs: dict[str, list[dict[str, Any]]] = {name: [] for name, *_ in sides}
        during: dict[str, list[dict[str, Any]]] = {
            name: [] for name, _, _, mode, _ in sides if mode == "ours"
        }
        rate = ["--lookup-rate", str(args.lookup_rate)]
        for r in range(args.repeat):
            for name, python, env, mode, extra in sides:
                runs[name].append(run_child(python, mode, data, env, extra))
                print(f"  repeat {r + 1} {name}: {json.dumps(runs[name][-1])}", flush=True)
            for name, python, env, mode, extra in sides:
                if mode == "ours":
                    during[name].append(run_child(python, "during", data, env, rate + extra))
        phases = run_child(sys.executable, "decode", data, {}, [])
        interleaved: dict[str, Any] | None = None
        if base_core:
            one = {"KVEVENTS_INGEST_THREADS": "1"}
            interleaved = run_child(
                sys.executable, "interleaved", data, one, [*base_core, "--repeat", str(args.repeat)]
            )
    results = {name: summarize(r) for name, r in runs.items()}
    ratios: dict[str, Any] = {}
    ours = results["kvevents (2 threads)"]
    for name, res in results.items():
        for stream, row in res.items():
            if name != "kvevents (2 threads)" and stream in ours:
                ratios[f"{stream}: 2 threads / {name}"] = ours[stream]["blocks_per_s"] / row["blocks_per_s"]
    report = {
        "command": shlex.join([sys.executable, *sys.argv]),
        "loadavg_start": load_start,
        "loadavg_end": os.getloadavg(),
        "config": config,
        "sides": results,
        "decode": phases,
        "during_ingest": {name: _median_during(rows) for name, rows in during.items()},
        "ratios": ratios,
        "interleaved": interleaved,
    }
    print(
        f"\n{'side':<26} {'fleet blocks/s':>15} {'per CPU-s':>12} {'realistic blocks/s':>19} {'per CPU-s':>12}"
    )
    for name, res in results.items():
        f, rr = res.get("fleet"), res["realistic"]
        fleet_cells = (
            f"{f['blocks_per_s']:>15,.0f} {f['blocks_per_cpu_s']:>12,.0f}" if f else f"{'-':>15} {'-':>12}"
        )
        print(f"{name:<26} {fleet_cells} {rr['blocks_per_s']:>19,.0f} {rr['blocks_per_cpu_s']:>12,.0f}")
    print("\nratios (medians):")
    for key, value in ratios.items():
        print(f"  {key}: {value:.2f}x")
    print(
        f"\nthis build's decoding thread alone, per block: {phases['decode_ns_per_block']:.0f} ns "
        f"(with the content hashes ahead: {phases['decode_and_content_ahead_ns_per_block']:.0f} ns)"
    )
    print("64-block lookups during ingest (medians of the repeats): p50 / p99 / batch apply mean, us")
    for name, d in report["during_ingest"].items():
        print(f"  {name:<26} {d['p50_us']:>8.0f} {d['p99_us']:>8.0f} {d['batch_apply_us_mean']:>8.0f}")
    if interleaved is not None:
        print("interleaved with the baseline core (one thread, CPU ns per block per repeat):")
        for stream_name, cpu in interleaved.items():
            this_ns = ", ".join(f"{x:.0f}" for x in cpu["ours_ns_per_block"])
            base_ns = ", ".join(f"{x:.0f}" for x in cpu["baseline_ns_per_block"])
            ratio = cpu["baseline_over_ours"]
            print(
                f"  {stream_name:<10} this build {this_ns}; baseline {base_ns}; baseline / this {ratio:.3f}x"
            )
    print(f"load average: start {load_start}, end {report['loadavg_end']}")
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
