"""The realistic stream's figures (``index_stream.py``: 256 workers, shared prompts and
documents, multi-turn growth, LRU Removed and level-moving Updated events): ingest (kvevents
from Avro bytes, Dynamo from its JSON events, the naive index from decoded batches), a 64-block
prefill-only stream, find_matches on the final state with a cross-check, memory per held
worker-block in fresh child processes, the in-memory rebuild, the state round trip and the
rebuilds from a Kafka topic and a checkpoint (``topic_rebuild.py``).
"""

from __future__ import annotations

import gc
import json
import os
import pickle
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from index_naive import NaiveIndex
from index_sides import ingest_method, load_dynamo, median_of, percentiles, query_floor
from index_sides import ingest_ours as feed_ours
from index_stream import Stream, StreamConfig, generate, worker_key
from kvevents.consumer import CacheIndex
from kvevents.schemas import decode_batch, encode_batch, fast_path_enabled


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b == 0 else a / b


# ------------------------------------------------------------------ ingest


def ingest_ours(encoded: list[bytes]) -> tuple[float, float, CacheIndex]:
    """(wall s, process CPU s, index) of decoding and applying every batch."""
    index = CacheIndex()
    gc.collect()
    cpu, start = time.process_time(), time.perf_counter()
    feed_ours(index, encoded)
    return time.perf_counter() - start, time.process_time() - cpu, index


def ingest_naive(decoded: list[Any]) -> tuple[float, float, NaiveIndex]:
    """(wall s, process CPU s, index) of the naive index fed the decoded batches."""
    index = NaiveIndex()
    gc.collect()
    cpu, start = time.process_time(), time.perf_counter()
    index.apply_all(decoded)
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
    """p50/p99/max/mean in microseconds per side: each pass times every query once, sides
    interleaved query by query (the machine's noise hits them alike); the median over the
    ``repeat`` passes."""
    clock = time.perf_counter_ns
    n = len(next(iter(sides.values()))[1])
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in sides}
    for _ in range(repeat):
        samples: dict[str, list[int]] = {name: [] for name in sides}
        for i in range(n):
            for name, (fn, args) in sides.items():
                t0 = clock()
                fn(args[i])
                samples[name].append(clock() - t0)
        for name, s in samples.items():
            runs[name].append(percentiles(s))
    return {name: median_of(r) for name, r in runs.items()}


def cross_check(index: CacheIndex, other: Any, stream: Stream, queries: list[Any]) -> dict[str, Any]:
    """How often the other index (Dynamo's tree or the naive one) answers the same per-worker
    counts (they should: leaf-only eviction), and the same best match (length and workers)."""
    dp = stream.config.dp_size
    same = same_best = 0
    for engine, local, _ in queries:
        ours = {(k.instance_id, k.attention_dp_rank): v for k, v in index.find_matches(engine).items()}
        if isinstance(other, NaiveIndex):
            theirs = other.find_matches(engine)
        else:
            theirs = {
                worker_key(stream, w * dp + r): v for (w, r), v in other.find_matches(local).scores.items()
            }
        same += ours == theirs
        same_best += _best(ours) == _best(theirs)
    return {"queries": len(queries), "identical_answers": same, "identical_best_matches": same_best}


def _best(answer: dict[Any, int]) -> tuple[int, frozenset[Any]]:
    top = max(answer.values(), default=0)
    return top, frozenset(w for w, v in answer.items() if v == top)


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
    if side == "naive":
        decoded = [decode_batch(b) for b in payload["encoded"]]
        del payload
        gc.collect()
        base_rss = rss_bytes()
        naive = NaiveIndex()
        naive.apply_all(decoded)
        gc.collect()
        return {"rss_delta": rss_bytes() - base_rss}
    radix_tree = load_dynamo()
    base_rss = rss_bytes()
    tree = radix_tree()
    for worker, event in payload["dynamo"]:
        tree.apply_event(worker, event)
    gc.collect()
    return {"rss_delta": rss_bytes() - base_rss}


SCRIPT = str(Path(__file__).resolve().parent.parent / "index.py")


def run_child(args: list[str], env: dict[str, str] | None = None) -> dict[str, Any]:
    """``bench/index.py`` with ``args`` in a child process (``env``: added to this one's)."""
    proc = subprocess.run(
        [sys.executable, SCRIPT, *args],
        capture_output=True,
        text=True,
        check=False,
        env=None if env is None else {**os.environ, **env},
    )
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
    elapsed = 0.0
    events = 0
    for k in range(copies):
        batch_bytes = renamed_copy(encoded, k)
        gc.collect()
        start = time.perf_counter()
        feed_ours(index, batch_bytes)
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


def rebuild_from_topic_and_checkpoint(payload: Path, config: StreamConfig, args: Any) -> dict[str, Any]:
    """Both Kafka rebuild measurements, in a fresh child (its index alone in its memory)."""
    if not args.topic_events:
        skipped = {"status": "skipped (--topic-events 0; --full rebuilds 10M events)"}
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


# ------------------------------------------------------------------ the whole part


def run_realistic(args: Any, radix_tree: Any) -> dict[str, Any]:
    """Every figure of the realistic stream (children run ``bench/index.py --child``)."""
    config = StreamConfig(target_events=args.events)
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
    ours_runs, dyn_runs, naive_runs = [], [], []
    index = tree = naive = None
    decoded = stream.batches  # the naive index is fed the batches decoded
    for _ in range(args.repeat):
        index = None
        wall, cpu, index = ingest_ours(encoded)
        ours_runs.append((wall, cpu))
        naive = None
        wall, cpu, naive = ingest_naive(decoded)
        naive_runs.append((wall, cpu))
        if radix_tree is not None:
            tree = None
            wall, cpu, tree = ingest_dynamo(radix_tree, stream.dynamo_events)
            dyn_runs.append((wall, cpu))
    assert index is not None
    if index.held_blocks() != stream.held_worker_blocks:
        raise SystemExit(
            f"index holds {index.held_blocks()} worker-blocks, the simulator {stream.held_worker_blocks}"
        )
    med = statistics.median
    ours_s, ours_cpu = med(w for w, _ in ours_runs), med(c for _, c in ours_runs)
    naive_s = med(w for w, _ in naive_runs)
    dyn_s = med(w for w, _ in dyn_runs) if dyn_runs else None
    dyn_cpu = med(c for _, c in dyn_runs) if dyn_runs else None
    ingest = {
        "ours": {
            "seconds": ours_s,
            "cpu_seconds": ours_cpu,
            "events_per_s": n_events / ours_s,
            "blocks_per_s": n_blocks / ours_s,
            "runs_wall_cpu_s": ours_runs,
            "compiled_core": index.compiled,
            "codec_fast_path": fast_path_enabled(),
            "method": ingest_method(),
        },
        "naive": {
            "seconds": naive_s,
            "events_per_s": n_events / naive_s,
            "blocks_per_s": n_blocks / naive_s,
            "runs_wall_cpu_s": naive_runs,
            "fed": "decoded EventBatch objects (decoding not timed)",
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
    ingest["vs_naive_blocks_per_s_ratio"] = ratio(naive_s, ours_s)
    ingest["cpu_events_per_s_ratio"] = ratio(n_events / ours_cpu, n_dynamo / dyn_cpu if dyn_cpu else None)
    ingest["cpu_same_stream_speedup"] = ratio(dyn_cpu, ours_cpu)
    via_codec = med(ingest_ours_via_codec(encoded) for _ in range(max(1, args.repeat - 1)))
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
    p_ours = med(ingest_ours(prefill_encoded)[0] for _ in range(args.repeat))
    p_naive = med(ingest_naive(prefill.batches)[0] for _ in range(args.repeat))
    p_dyn = (
        med(ingest_dynamo(radix_tree, prefill.dynamo_events)[0] for _ in range(args.repeat))
        if radix_tree
        else None
    )
    ingest["long_prefill_stream"] = {
        "events": prefill.events,
        "blocks": prefill.blocks_stored,
        "ours_blocks_per_s": prefill.blocks_stored / p_ours,
        "dynamo_blocks_per_s": None if p_dyn is None else prefill.blocks_stored / p_dyn,
        "naive_blocks_per_s": prefill.blocks_stored / p_naive,
        "blocks_per_s_ratio": ratio(p_dyn, p_ours),
        "vs_naive_blocks_per_s_ratio": ratio(p_naive, p_ours),
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
        sides["naive_find_matches"] = (naive.find_matches, engine)
        row: dict[str, Any] = latencies(sides, max(args.repeat, 5))
        if tree is not None:
            row["p99_ratio"] = ratio(row["ours_find_matches"]["p99_us"], row["dynamo_find_matches"]["p99_us"])
            row["p50_ratio"] = ratio(row["ours_find_matches"]["p50_us"], row["dynamo_find_matches"]["p50_us"])
            row["cross_check"] = cross_check(index, tree, stream, qs[: args.cross_check])
        row["naive_p99_ratio"] = ratio(
            row["ours_find_matches"]["p99_us"], row["naive_find_matches"]["p99_us"]
        )
        row["naive_cross_check"] = cross_check(index, naive, stream, qs[: args.cross_check])
        if size == 64:
            others = [
                (sides[k][0], sides[k][1])
                for k in ("dynamo_find_matches", "naive_find_matches")
                if k in sides
            ]
            row["floor"] = query_floor(index, others, engine, max(args.repeat, 5))
        row["mean_matched_blocks_best_worker"] = statistics.fmean(
            max(index.find_matches(e).values(), default=0) for e in engine[:300]
        )
        queries[str(size)] = row

    state = state_round_trip(index)
    del tree, naive
    gc.collect()

    # ---- memory and rebuild in fresh children
    with tempfile.TemporaryDirectory() as tmp:
        payload = Path(tmp) / "stream.pickle"
        with open(payload, "wb") as f:
            pickle.dump({"encoded": encoded, "dynamo": stream.dynamo_events, "events": n_events}, f)
        mem_ours = run_child(["--child", "memory-ours", "--payload", str(payload)])
        mem_traced = run_child(["--child", "memory-ours-traced", "--payload", str(payload)])
        mem_dyn = run_child(["--child", "memory-dynamo", "--payload", str(payload)]) if radix_tree else None
        mem_naive = run_child(["--child", "memory-naive", "--payload", str(payload)])
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
        "naive_rss_bytes_per_worker_block": mem_naive["rss_delta"] / held,
    }
    memory["rss_ratio"] = ratio(
        memory["ours_rss_bytes_per_worker_block"], memory["dynamo_rss_bytes_per_worker_block"]
    )
    memory["traced_vs_dynamo_rss_ratio"] = ratio(
        memory["ours_traced_bytes_per_worker_block"], memory["dynamo_rss_bytes_per_worker_block"]
    )

    return {
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
        "ingest": ingest,
        "find_matches": queries,
        "memory": memory,
        "rebuild_in_memory": rebuild,
        "state_round_trip": state,
        "rebuild_from_topic": kafka_rebuilds["rebuild_from_topic"],
        "rebuild_from_checkpoint": kafka_rebuilds["rebuild_from_checkpoint"],
    }
