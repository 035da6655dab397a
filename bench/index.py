"""Benchmark of the global cache index against NVIDIA Dynamo's RadixTree, side by side.

    python bench/index.py            # full run (about 3-5 minutes on 2 cores)
    python bench/index.py --quick    # a smaller stream, for a smoke test

One realistic seeded stream (``support/index_stream.py``: 256 workers = 32 instances x 8 attention-DP
ranks, shared system prompts and documents, multi-turn growth, 1-4 block and 64-block Stored
events, LRU Removed and level-moving Updated events) is generated once, then:

- ingest: kvevents decodes and applies the encoded Avro batches (``apply_encoded``: time =
  decode + apply); Dynamo's ``RadixTree.apply_event`` gets its JSON events (time = the calls).
  Events/s are each side's own events (Dynamo gets no Updated events: it has no levels), and
  the same-stream speedup (Dynamo's time / ours for the whole stream) is reported too;
- find_matches p50/p99 for 64- and 512-block queries (half held prefixes, half partial
  matches with an unknown tail) on the final state, ours by engine hash and by tokens, Dynamo
  by its tokens hashes (``.scores`` read, so both build their result dict); the answers are
  cross-checked;
- memory per held worker-block, each side in a fresh child process: RSS delta (both) and
  tracemalloc (ours; Dynamo's Rust allocations are invisible to it);
- rebuild: decode + apply of >= 10M events from pre-encoded bytes in memory (the stream
  replicated to more instances), and the marked places for the reader and checkpoint helpers.

Timings repeat (``--repeat``) and report the best; the machine is shared, so compare the
ratios of one run. Results: ``bench/results/index.json``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import pickle
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent / "support"))

from index_stream import Stream, StreamConfig, generate, worker_key
from kvevents.consumer import CacheIndex
from kvevents.consumer.index import compiled_core_available
from kvevents.schemas import decode_batch, encode_batch, fast_path_enabled

RESULTS = Path(__file__).resolve().parent / "results" / "index.json"

TARGETS = {
    "ingest_events_ratio": 5.0,
    "ingest_blocks_ratio": 1.0,
    "find_matches_p99_ratio": 1.0,
    "memory_per_worker_block_ratio": 1.0,
    "rebuild_10m_topic_s": 60.0,
    "rebuild_checkpoint_s": 5.0,
}


def load_dynamo() -> Any:
    """Dynamo's RadixTree class, or None when ai-dynamo-runtime is not installed."""
    try:
        from dynamo.llm import RadixTree
    except ImportError:
        return None
    os.environ.setdefault("DYN_LOG", "error")
    return RadixTree


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


# ------------------------------------------------------------------ ingest


def ingest_ours(encoded: list[bytes]) -> tuple[float, float, CacheIndex]:
    """(wall s, process CPU s, index) of decoding and applying every batch."""
    index = CacheIndex()
    apply = index.apply_encoded
    gc.collect()
    cpu, start = time.process_time(), time.perf_counter()
    for data in encoded:
        apply(data)
    return time.perf_counter() - start, time.process_time() - cpu, index


def ingest_ours_via_codec(encoded: list[bytes]) -> float:
    """Wall seconds of ``decode_batch`` (the codec, compiled when built) then ``apply``: the
    path of a reader that wants the batch objects too."""
    index = CacheIndex()
    apply = index.apply
    gc.collect()
    start = time.perf_counter()
    for data in encoded:
        apply(decode_batch(data))
    return time.perf_counter() - start


def ingest_dynamo(radix_tree: Any, events: list[tuple[int, bytes]]) -> tuple[float, float, Any]:
    """(wall s, process CPU s, tree) of applying every JSON event; a final find_matches makes
    sure the tree (which works with a helper thread) has taken them all."""
    tree = radix_tree()
    apply = tree.apply_event
    gc.collect()
    cpu, start = time.process_time(), time.perf_counter()
    for worker, event in events:
        apply(worker, event)
    tree.find_matches([0])
    return time.perf_counter() - start, time.process_time() - cpu, tree


# ------------------------------------------------------------------ queries


def make_queries(
    stream: Stream, size: int, count: int, seed: int
) -> list[tuple[list[int], list[int], list[int]]]:
    """(engine hashes, Dynamo tokens hashes, token ids) of ``count`` queries of ``size`` blocks:
    half a held conversation prefix (as long as held), half a held prefix cut short, then blocks
    no worker holds."""
    rng = random.Random(seed)
    held_paths = [
        path for worker, path in stream.conversations if path and path[0] in stream.worker_held[worker]
    ]
    long_paths = [p for p in held_paths if len(p) >= size] or held_paths
    queries = []
    for i in range(count):
        path = rng.choice(long_paths if i % 2 == 0 else held_paths)
        keep = min(len(path), size) if i % 2 == 0 else rng.randint(1, min(len(path), size))
        ids = path[:keep]
        engine = [stream.engine_hashes[b] for b in ids]
        local = [stream.local_hashes[b] for b in ids]
        tokens = [t for b in ids for t in stream.tokens[b]]
        for _ in range(size - keep):
            engine.append(rng.getrandbits(64))
            local.append(rng.getrandbits(64))
            tokens.extend(rng.randrange(1 << 17) for _ in range(stream.config.block_size))
        queries.append((engine, local, tokens))
    return queries


def latencies(sides: dict[str, tuple[Any, list[Any]]], repeat: int) -> dict[str, dict[str, float]]:
    """p50/p99/mean in microseconds per side. Each query runs ``repeat`` times, sides
    interleaved query by query, and keeps its fastest run: scheduling noise from the other
    processes on the machine is stripped the same way for every side."""
    clock = time.perf_counter_ns
    n = len(next(iter(sides.values()))[1])
    best = {name: [float("inf")] * n for name in sides}
    for _ in range(repeat):
        for i in range(n):
            for name, (fn, args) in sides.items():
                t0 = clock()
                fn(args[i])
                elapsed = clock() - t0
                if elapsed < best[name][i]:
                    best[name][i] = elapsed
    out = {}
    for name, samples in best.items():
        samples.sort()
        out[name] = {
            "p50_us": samples[len(samples) // 2] / 1000,
            "p99_us": samples[min(len(samples) - 1, int(len(samples) * 0.99))] / 1000,
            "mean_us": statistics.fmean(samples) / 1000,
        }
    return out


def cross_check(index: CacheIndex, tree: Any, stream: Stream, queries: list[Any]) -> dict[str, Any]:
    """How often both answer the same per-worker counts (they should: leaf-only eviction)."""
    dp = stream.config.dp_size
    same = 0
    for engine, local, _ in queries:
        ours = {(k.instance_id, k.attention_dp_rank): v for k, v in index.find_matches(engine).items()}
        theirs = {worker_key(stream, w * dp + r): v for (w, r), v in tree.find_matches(local).scores.items()}
        same += ours == theirs
    return {"queries": len(queries), "identical_answers": same}


# ------------------------------------------------------------------ memory (child processes)


def memory_child(side: str, path: str, tracemalloc_on: bool) -> dict[str, Any]:
    with open(path, "rb") as f:
        payload = pickle.load(f)
    gc.collect()
    if side == "ours":
        import tracemalloc

        if tracemalloc_on:
            tracemalloc.start()
        base_rss = rss_bytes()
        base_traced = tracemalloc.get_traced_memory()[0] if tracemalloc_on else 0
        index = CacheIndex()
        for data in payload["encoded"]:
            index.apply_encoded(data)
        gc.collect()
        out = {
            "rss_delta": rss_bytes() - base_rss,
            "held_worker_blocks": index.held_blocks(),
            "distinct_blocks": index.stats().distinct_blocks,
            "memory_bytes_estimate": index.memory_bytes(),
        }
        if tracemalloc_on:
            out["traced_delta"] = tracemalloc.get_traced_memory()[0] - base_traced
        return out
    radix_tree = load_dynamo()
    base_rss = rss_bytes()
    tree = radix_tree()
    for worker, event in payload["dynamo"]:
        tree.apply_event(worker, event)
    gc.collect()
    return {"rss_delta": rss_bytes() - base_rss}


def run_child(args: list[str]) -> dict[str, Any]:
    proc = subprocess.run([sys.executable, __file__, *args], capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"child {args} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


# ------------------------------------------------------------------ rebuild


def rebuild_child(path: str, target_events: int) -> dict[str, Any]:
    """Decode + apply ``target_events`` from bytes in memory: the stream, replicated to more
    instances (copy k renames every instance id), so the index grows as a bigger fleet's would."""
    from topic_rebuild import renamed_copy

    with open(path, "rb") as f:
        payload = pickle.load(f)
    encoded: list[bytes] = payload["encoded"]
    per_copy = payload["events"]
    copies = -(-target_events // per_copy)
    index = CacheIndex()
    apply = index.apply_encoded
    elapsed = 0.0
    events = 0
    for k in range(copies):
        batch_bytes = renamed_copy(encoded, k)
        gc.collect()
        start = time.perf_counter()
        for data in batch_bytes:
            apply(data)
        elapsed += time.perf_counter() - start
        events += per_copy
        del batch_bytes
    return {
        "events": events,
        "copies": copies,
        "seconds": elapsed,
        "events_per_s": events / elapsed,
        "workers": index.stats().workers,
        "held_worker_blocks": index.held_blocks(),
        "memory_bytes_estimate": index.memory_bytes(),
        "max_rss_bytes": rss_bytes(),
    }


def topic_child(path: str, config: StreamConfig, target_events: int, repeat: int) -> dict[str, Any]:
    """Rebuild from a real Kafka topic of ``target_events`` events with the EventReader (target
    < 60 s), and from a checkpoint of it, file and compacted topic, plus the tail (target < 5 s):
    see ``support/topic_rebuild.py``."""
    from topic_rebuild import run

    with open(path, "rb") as f:
        payload = pickle.load(f)
    return run(payload, config, target_events, repeat)


def rebuild_from_topic_and_checkpoint(
    payload: Path, config: StreamConfig, args: argparse.Namespace
) -> dict[str, Any]:
    """Both Kafka rebuild measurements, in a fresh child (its index alone in its memory)."""
    if not args.topic_events:
        skipped = {"status": "skipped (--topic-events 0)"}
        return {"rebuild_from_topic": skipped, "rebuild_from_checkpoint": skipped}
    return run_child(
        [
            "--child",
            "topic",
            "--payload",
            str(payload),
            "--events",
            str(config.target_events),
            "--topic-events",
            str(args.topic_events),
            "--repeat",
            str(args.topic_repeat),
        ]
    )


def state_round_trip(index: CacheIndex) -> dict[str, Any]:
    """to_bytes / from_bytes of the benchmark's final index (the checkpoint's core cost)."""
    start = time.perf_counter()
    data = index.to_bytes()
    saved = time.perf_counter() - start
    start = time.perf_counter()
    restored = CacheIndex.from_bytes(data)
    loaded = time.perf_counter() - start
    return {
        "bytes": len(data),
        "to_bytes_s": saved,
        "from_bytes_s": loaded,
        "equal": restored.to_bytes() == data,
    }


# ------------------------------------------------------------------ main


def ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b == 0 else a / b


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a small stream (smoke test)")
    parser.add_argument(
        "--events", type=int, default=None, help="events in the stream (default 600k, quick 60k)"
    )
    parser.add_argument("--repeat", type=int, default=3, help="timing repetitions (best is kept)")
    parser.add_argument("--queries", type=int, default=2000, help="queries per size")
    parser.add_argument(
        "--rebuild-events", type=int, default=10_000_000, help="events of the in-memory rebuild (0: skip)"
    )
    parser.add_argument("--output", type=Path, default=RESULTS)
    parser.add_argument(
        "--topic-events",
        type=int,
        default=10_000_000,
        help="events of the rebuild from a Kafka topic and a checkpoint (0: skip)",
    )
    parser.add_argument("--topic-repeat", type=int, default=2, help="repetitions of the topic rebuild")
    parser.add_argument(
        "--child",
        choices=["memory-ours", "memory-ours-traced", "memory-dynamo", "rebuild", "topic"],
        help=argparse.SUPPRESS,
    )
    parser.add_argument("--payload", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.child:
        if args.child == "rebuild":
            result = rebuild_child(args.payload, args.rebuild_events)
        elif args.child == "topic":
            config = StreamConfig(target_events=args.events)
            result = topic_child(args.payload, config, args.topic_events, args.repeat)
        else:
            side = "dynamo" if args.child == "memory-dynamo" else "ours"
            result = memory_child(side, args.payload, args.child == "memory-ours-traced")
        print(json.dumps(result))
        return 0

    config = StreamConfig(target_events=args.events or (60_000 if args.quick else 600_000))
    if args.quick:
        args.queries = min(args.queries, 400)
        args.repeat = min(args.repeat, 2)
        args.rebuild_events = min(args.rebuild_events, 300_000)
        args.topic_events = min(args.topic_events, 300_000)
        args.topic_repeat = 1
    radix_tree = load_dynamo()
    if radix_tree is None:
        print(
            "!! NVIDIA Dynamo (pip install 'kvevents[bench-dynamo]', ai-dynamo-runtime==1.6.1) is not "
            "installed: measuring kvevents only, no baseline, no ratios",
            file=sys.stderr,
        )
    if not compiled_core_available():
        print("!! kvevents.consumer._indexcore is not built: measuring the pure-Python core", file=sys.stderr)

    t0 = time.perf_counter()
    stream = generate(config)
    generated_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    encoded = [encode_batch(b) for b in stream.batches]
    encode_s = time.perf_counter() - t0
    n_events, n_blocks = stream.events, stream.blocks_stored
    n_dynamo = len(stream.dynamo_events)
    print(
        f"stream: {n_events:,} events ({stream.events_by_kind}), {n_blocks:,} blocks stored, "
        f"{len(stream.batches):,} batches, {sum(map(len, encoded)) / 1e6:.1f} MB Avro; "
        f"generated in {generated_s:.1f} s, encoded in {encode_s:.1f} s",
        file=sys.stderr,
    )

    # ---- ingest, alternating sides; best wall time and best CPU time of the repeats
    ours_runs, dyn_runs = [], []
    index = tree = None
    for _ in range(args.repeat):
        index = None
        wall, cpu, index = ingest_ours(encoded)
        ours_runs.append((wall, cpu))
        if radix_tree is not None:
            tree = None
            wall, cpu, tree = ingest_dynamo(radix_tree, stream.dynamo_events)
            dyn_runs.append((wall, cpu))
    assert index is not None
    if index.held_blocks() != stream.held_worker_blocks:
        raise SystemExit(
            f"index holds {index.held_blocks()} worker-blocks, the simulator {stream.held_worker_blocks}"
        )
    ours_s, ours_cpu = min(w for w, _ in ours_runs), min(c for _, c in ours_runs)
    dyn_s = min(w for w, _ in dyn_runs) if dyn_runs else None
    dyn_cpu = min(c for _, c in dyn_runs) if dyn_runs else None
    ingest = {
        "ours": {
            "seconds": ours_s,
            "cpu_seconds": ours_cpu,
            "events_per_s": n_events / ours_s,
            "blocks_per_s": n_blocks / ours_s,
            "runs_wall_cpu_s": ours_runs,
            "compiled_core": index.compiled,
            "codec_fast_path": fast_path_enabled(),
        },
        "dynamo": None
        if dyn_s is None
        else {
            "seconds": dyn_s,
            "cpu_seconds": dyn_cpu,
            "events": n_dynamo,
            "events_per_s": n_dynamo / dyn_s,
            "blocks_per_s": n_blocks / dyn_s,
            "runs_wall_cpu_s": dyn_runs,
        },
    }
    ingest["events_per_s_ratio"] = ratio(n_events / ours_s, n_dynamo / dyn_s if dyn_s else None)
    ingest["blocks_per_s_ratio"] = ratio(n_blocks / ours_s, n_blocks / dyn_s if dyn_s else None)
    ingest["same_stream_speedup"] = ratio(dyn_s, ours_s)
    ingest["cpu_events_per_s_ratio"] = ratio(n_events / ours_cpu, n_dynamo / dyn_cpu if dyn_cpu else None)
    ingest["cpu_same_stream_speedup"] = ratio(dyn_cpu, ours_cpu)
    via_codec = min(ingest_ours_via_codec(encoded) for _ in range(max(1, args.repeat - 1)))
    ingest["ours_via_decode_batch"] = {
        "seconds": via_codec,
        "events_per_s": n_events / via_codec,
        "events_per_s_ratio": ratio(n_events / via_codec, n_dynamo / dyn_s if dyn_s else None),
    }

    # ---- a 64-block-prefill-only stream: Dynamo's best case in blocks/s
    prefill_cfg = StreamConfig(
        target_events=max(2000, config.target_events // 30),
        new_conversation=1.0,
        with_documents=1.0,
        long_context=0.0,
        reply_blocks=(0, 0),
        user_blocks=(1, 1),
        system_blocks=(1, 1),
        documents=5000,
        primary_blocks=1 << 20,
        secondary_blocks=0,
    )
    prefill = generate(prefill_cfg)
    prefill_encoded = [encode_batch(b) for b in prefill.batches]
    p_ours = min(ingest_ours(prefill_encoded)[0] for _ in range(args.repeat))
    p_dyn = (
        min(ingest_dynamo(radix_tree, prefill.dynamo_events)[0] for _ in range(args.repeat))
        if radix_tree
        else None
    )
    ingest["long_prefill_stream"] = {
        "events": prefill.events,
        "blocks": prefill.blocks_stored,
        "ours_blocks_per_s": prefill.blocks_stored / p_ours,
        "dynamo_blocks_per_s": None if p_dyn is None else prefill.blocks_stored / p_dyn,
        "blocks_per_s_ratio": ratio(p_dyn, p_ours),
    }
    del prefill, prefill_encoded

    # ---- queries on the final state
    queries: dict[str, Any] = {}
    for size in (64, 512):
        qs = make_queries(stream, size, args.queries, seed=size)
        engine = [q[0] for q in qs]
        local = [q[1] for q in qs]
        tokens = [q[2] for q in qs]
        block_size = config.block_size
        sides: dict[str, tuple[Any, list[Any]]] = {
            "ours_find_matches": (index.find_matches, engine),
            "ours_find_matches_for_tokens": (
                lambda t, bs=block_size: index.find_matches_for_tokens(t, bs),
                tokens,
            ),
        }
        if tree is not None:
            sides["dynamo_find_matches"] = (lambda q, t=tree: t.find_matches(q).scores, local)
        row: dict[str, Any] = latencies(sides, max(args.repeat, 5))
        if tree is not None:
            row["p99_ratio"] = ratio(row["ours_find_matches"]["p99_us"], row["dynamo_find_matches"]["p99_us"])
            row["p50_ratio"] = ratio(row["ours_find_matches"]["p50_us"], row["dynamo_find_matches"]["p50_us"])
            row["cross_check"] = cross_check(index, tree, stream, qs[:200])
        row["mean_matched_blocks_best_worker"] = statistics.fmean(
            max(index.find_matches(e).values(), default=0) for e in engine[:300]
        )
        queries[str(size)] = row

    state = state_round_trip(index)
    del tree
    gc.collect()

    # ---- memory and rebuild in fresh children
    with tempfile.TemporaryDirectory() as tmp:
        payload = Path(tmp) / "stream.pickle"
        with open(payload, "wb") as f:
            pickle.dump({"encoded": encoded, "dynamo": stream.dynamo_events, "events": n_events}, f)
        mem_ours = run_child(["--child", "memory-ours", "--payload", str(payload)])
        mem_traced = run_child(["--child", "memory-ours-traced", "--payload", str(payload)])
        mem_dyn = run_child(["--child", "memory-dynamo", "--payload", str(payload)]) if radix_tree else None
        rebuild = (
            run_child(
                [
                    "--child",
                    "rebuild",
                    "--payload",
                    str(payload),
                    "--rebuild-events",
                    str(args.rebuild_events),
                ]
            )
            if args.rebuild_events
            else None
        )
        kafka_rebuilds = rebuild_from_topic_and_checkpoint(payload, config, args)
    held = mem_ours["held_worker_blocks"]
    memory = {
        "held_worker_blocks": held,
        "distinct_blocks": mem_ours["distinct_blocks"],
        "ours_rss_bytes_per_worker_block": mem_ours["rss_delta"] / held,
        "ours_traced_bytes_per_worker_block": mem_traced["traced_delta"] / held,
        "ours_estimate_bytes_per_worker_block": mem_ours["memory_bytes_estimate"] / held,
        "dynamo_rss_bytes_per_worker_block": None if mem_dyn is None else mem_dyn["rss_delta"] / held,
    }
    memory["rss_ratio"] = ratio(
        memory["ours_rss_bytes_per_worker_block"], memory["dynamo_rss_bytes_per_worker_block"]
    )
    memory["traced_vs_dynamo_rss_ratio"] = ratio(
        memory["ours_traced_bytes_per_worker_block"], memory["dynamo_rss_bytes_per_worker_block"]
    )

    results = {
        "benchmark": "index",
        "machine": {
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
        },
        "config": config.__dict__,
        "stream": {
            "events": n_events,
            "events_by_kind": stream.events_by_kind,
            "blocks_stored": n_blocks,
            "batches": len(stream.batches),
            "avro_bytes": sum(map(len, encoded)),
            "dynamo_events": n_dynamo,
            "workers": config.instances * config.dp_size,
            "held_worker_blocks": stream.held_worker_blocks,
        },
        "targets": TARGETS,
        "ingest": ingest,
        "find_matches": queries,
        "memory": memory,
        "rebuild_in_memory_10m": rebuild,
        "state_round_trip": state,
        "rebuild_from_topic_10m": kafka_rebuilds["rebuild_from_topic"],
        "rebuild_from_checkpoint": kafka_rebuilds["rebuild_from_checkpoint"],
        "dynamo_available": radix_tree is not None,
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(results, indent=2, default=str) + "\n")
    print_table(results)
    print(f"\nwrote {args.output}")
    return 0


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _verdict(value: float | None, target: float, higher_is_better: bool) -> str:
    if value is None:
        return "n/a"
    ok = value >= target if higher_is_better else value <= target
    return "MET" if ok else "MISSED"


def print_kafka_rebuilds(topic: dict[str, Any], ckpt: dict[str, Any]) -> None:
    """The rebuilds from a real Kafka topic and from a checkpoint, with what they needed."""
    if topic.get("status") != "measured":
        print(f"{'rebuild from a Kafka topic':34} {topic.get('status')}")
        return
    p = topic["production"]
    print(
        f"\nrebuild from Kafka topic {topic['topic']} ({topic['partitions']} partitions, broker: "
        f"{topic['broker']['source']}, JVM {' '.join(topic['broker'].get('jvm_options', [])) or 'external'})"
    )
    first = p if p["produced_now"] else (p.get("when_produced") or {})
    made = "reused from an earlier run" if not p["produced_now"] else "produced now"
    if first:
        made += (
            f"; producing took {first['produce_s']:.1f} s ({first['value_bytes'] / 1e9:.2f} GB of Avro, "
            f"{first['produce_mb_per_s']:.0f} MB/s, zstd)"
        )
    disk = "-" if p.get("disk_bytes") is None else f"{p['disk_bytes'] / 1e9:.2f} GB on disk"
    print(f"  topic: {p['messages']:,} messages, {made}, {disk}")
    for name, row in topic["raw_fetch"].items():
        print(f"  raw read, {name:22} {row['seconds']:7.1f} s  {row['mb_per_s']:7.0f} MB/s")
    for name, rows in topic["runs"].items():
        runs = ", ".join(f"{r['seconds']:.1f}" for r in rows)
        print(f"  rebuild, {name:24} {min(r['seconds'] for r in rows):7.1f} s  (runs {runs} s)")
    print(
        f"  {'rebuild ' + format(topic['events'] / 1e6, '.1f') + 'M events':32} {topic['seconds']:7.1f} s "
        f"({topic['events_per_s']:,.0f} events/s, CPU {topic['cpu_seconds']:.1f} s, RSS "
        f"{topic['max_rss_bytes'] / 1e9:.2f} GB)   target < 60 s: {_verdict(topic['seconds'], 60.0, False)}"
    )
    fast = topic.get("fast_start_jvm")
    if fast:
        print(
            f"  broker with fast-start JVM ({' '.join(fast['jvm_options'])}): raw read "
            f"{fast['raw_read']['seconds']:.1f} s (vs {fast['throughput_jvm_raw_read_s']:.1f}), rebuild "
            f"{fast['rebuild']['seconds']:.1f} s (vs {fast['throughput_jvm_rebuild_s']:.1f})"
        )
    if ckpt.get("status") != "measured":
        return
    print(
        f"  checkpoint: {ckpt['state_bytes'] / 1e6:.1f} MB, capture {ckpt['capture_s']:.2f} s, file save "
        f"{ckpt['save_file_s']:.2f} s, Kafka save {ckpt['save_kafka_s']:.2f} s ({ckpt['kafka_chunks']} chunks); "
        f"tail {ckpt['tail_messages']:,} messages"
    )
    for source in ("file", "kafka"):
        c = ckpt[source]
        print(
            f"  restore from {source:5} + catch up  {c['seconds']:7.2f} s (load {c['load_s']:.2f}, restore + "
            f"{c['tail_events']:,} tail events {c['restore_and_catch_up_s']:.2f})  equals full rebuild: "
            f"{c['equals_full_rebuild']}   target < 5 s: {_verdict(c['seconds'], 5.0, False)}"
        )


def print_table(r: dict[str, Any]) -> None:
    ing, mem = r["ingest"], r["memory"]
    dyn = ing["dynamo"] or {}
    lp = ing["long_prefill_stream"]
    rows = [
        (
            "ingest events/s",
            ing["ours"]["events_per_s"],
            dyn.get("events_per_s"),
            ing["events_per_s_ratio"],
            ">= 5x",
            _verdict(ing["events_per_s_ratio"], 5.0, True),
        ),
        (
            "ingest blocks/s",
            ing["ours"]["blocks_per_s"],
            dyn.get("blocks_per_s"),
            ing["blocks_per_s_ratio"],
            ">= 1x",
            _verdict(ing["blocks_per_s_ratio"], 1.0, True),
        ),
        (
            "  same-stream speedup (wall)",
            ing["ours"]["seconds"],
            dyn.get("seconds"),
            ing["same_stream_speedup"],
            "(info)",
            "",
        ),
        (
            "  same-stream speedup (CPU)",
            ing["ours"]["cpu_seconds"],
            dyn.get("cpu_seconds"),
            ing["cpu_same_stream_speedup"],
            "(info)",
            "",
        ),
        ("  events/s ratio on CPU time", None, None, ing["cpu_events_per_s_ratio"], "(info)", ""),
        (
            "  via decode_batch + apply ev/s",
            ing["ours_via_decode_batch"]["events_per_s"],
            None,
            ing["ours_via_decode_batch"]["events_per_s_ratio"],
            "(info)",
            "",
        ),
        (
            "  64-block prefills blocks/s",
            lp["ours_blocks_per_s"],
            lp["dynamo_blocks_per_s"],
            lp["blocks_per_s_ratio"],
            ">= 1x",
            _verdict(lp["blocks_per_s_ratio"], 1.0, True),
        ),
    ]
    for size in ("64", "512"):
        q = r["find_matches"][size]
        d = q.get("dynamo_find_matches", {})
        rows.append(
            (
                f"find_matches {size} p99 us",
                q["ours_find_matches"]["p99_us"],
                d.get("p99_us"),
                q.get("p99_ratio"),
                "<= 1x",
                _verdict(q.get("p99_ratio"), 1.0, False),
            )
        )
        rows.append(
            (
                f"find_matches {size} p50 us",
                q["ours_find_matches"]["p50_us"],
                d.get("p50_us"),
                q.get("p50_ratio"),
                "(info)",
                "",
            )
        )
        rows.append(
            (
                f"  for_tokens {size} p99 us",
                q["ours_find_matches_for_tokens"]["p99_us"],
                None,
                None,
                "(info)",
                "",
            )
        )
    rows.append(
        (
            "bytes/worker-block (RSS)",
            mem["ours_rss_bytes_per_worker_block"],
            mem["dynamo_rss_bytes_per_worker_block"],
            mem["rss_ratio"],
            "<= 1x",
            _verdict(mem["rss_ratio"], 1.0, False),
        )
    )
    rows.append(
        (
            "bytes/worker-block (traced)",
            mem["ours_traced_bytes_per_worker_block"],
            None,
            mem["traced_vs_dynamo_rss_ratio"],
            "<= 1x",
            _verdict(mem["traced_vs_dynamo_rss_ratio"], 1.0, False),
        )
    )
    rb = r["rebuild_in_memory_10m"]
    if rb:
        rows.append(
            (
                f"rebuild {rb['events'] / 1e6:.1f}M events s",
                rb["seconds"],
                None,
                None,
                "< 60 s (topic)",
                _verdict(rb["seconds"], 60.0, False) + " (bytes in memory)",
            )
        )
    print(f"\n{'metric':34} {'kvevents':>14} {'Dynamo':>14} {'ratio':>8}  {'target':>14}  verdict")
    for name, ours, theirs, rat, target, verdict in rows:
        print(
            f"{name:34} {_fmt(ours, ',.1f'):>14} {_fmt(theirs, ',.1f'):>14} {_fmt(rat, '.2f'):>8}  {target:>14}  {verdict}"
        )
    print_kafka_rebuilds(r["rebuild_from_topic_10m"], r["rebuild_from_checkpoint"])
    s = r["stream"]
    print(
        f"\nstream: {s['events']:,} events, {s['blocks_stored']:,} blocks, {s['workers']} workers, "
        f"{s['held_worker_blocks']:,} worker-blocks held at the end; Dynamo got {s['dynamo_events']:,} events "
        f"(no Updated)"
    )
    for size in ("64", "512"):
        cc = r["find_matches"][size].get("cross_check")
        if cc:
            print(
                f"cross-check {size}-block queries: {cc['identical_answers']}/{cc['queries']} identical answers"
            )
    st = r["state_round_trip"]
    print(
        f"state: {st['bytes'] / 1e6:.1f} MB, to_bytes {st['to_bytes_s']:.2f} s, from_bytes {st['from_bytes_s']:.2f} s"
    )


if __name__ == "__main__":
    sys.exit(main())
