"""The matrix of issue 17 on the synthetic fleet (``index_fleet.py``): 16, 256 and 1,024
workers; kvevents, Dynamo's RadixTree and the naive index side by side; ingest alone, lookups
alone (1, 64 and 512 blocks) and lookups from a second thread while a thread ingests.

Every worker count gets the same total of worker-blocks (``--matrix-worker-blocks``), a scale
Dynamo and the naive index ingest in seconds. Ingest: a fresh index is fed the whole stream,
its two halves timed apart (the second half onto the first, as in the concurrent run); the
median over the repeats. Lookups alone: on the final state of the last ingest, sides
interleaved query by query, p50/p99/max per pass, medians over the passes. Concurrent: a fresh
index fed the first half, then the second half while a second thread sends 64-block lookups
on a schedule (``--lookup-rate`` per second; latency from each lookup's scheduled time).
"""

from __future__ import annotations

import functools
import gc
import statistics
import time
from typing import Any

from index_fleet import FleetConfig, fleet_instance_id, generate_fleet, make_fleet_queries
from index_sides import (
    Side,
    index_with_core,
    ingest_ours,
    load_core,
    lookups_during_ingest,
    lookups_interleaved,
    make_sides,
    query_floor,
    timed_ingest,
)
from kvevents.consumer import CacheIndex
from kvevents.schemas import decode_batch

QUERY_SIZES = (1, 64, 512)


def _answers_ours(index: Any, query: list[int]) -> dict[tuple[str, int], int]:
    return {(k.instance_id, k.attention_dp_rank): v for k, v in index.find_matches(query).items()}


def _answers_dynamo(tree: Any, query: list[int]) -> dict[tuple[str, int], int]:
    return {(fleet_instance_id(w), r): v for (w, r), v in tree.find_matches(query).scores.items()}


def _best(answer: dict[tuple[str, int], int]) -> tuple[int, frozenset[tuple[str, int]]]:
    top = max(answer.values(), default=0)
    return top, frozenset(w for w, v in answer.items() if v == top)


def cross_check(objs: dict[str, Any], queries: list[tuple[list[int], list[int]]]) -> dict[str, Any]:
    """Against kvevents: same best match (length and workers) and same whole answer."""
    ours = objs.get("kvevents")
    out: dict[str, Any] = {"queries": len(queries)}
    if ours is None:
        return out
    mine = [_answers_ours(ours, q[0]) for q in queries]
    others = {
        "dynamo": lambda q: _answers_dynamo(objs["dynamo"], q[1]),
        "naive": lambda q: objs["naive"].find_matches(q[0]),
    }
    for name, answer in others.items():
        if name not in objs:
            continue
        theirs = [answer(q) for q in queries]
        out[name] = {
            "identical_best_matches": sum(_best(a) == _best(b) for a, b in zip(mine, theirs, strict=True)),
            "identical_answers": sum(a == b for a, b in zip(mine, theirs, strict=True)),
        }
    return out


def run_cell(workers: int, args: Any, radix_tree: Any) -> dict[str, Any]:
    """Everything for one worker count."""
    budget = max(64, args.matrix_worker_blocks // workers)
    config = FleetConfig(  # conversations and shared prefixes scaled to small caches
        workers=workers,
        blocks_per_worker=budget,
        private_blocks=(min(16, budget // 8), max(16, min(384, budget // 2))),
        docs_per_prefix=(0, min(6, budget // 256)),
    )
    started = t0 = time.perf_counter()
    stream = generate_fleet(config, dynamo=radix_tree is not None)
    gen_s = time.perf_counter() - t0
    decoded = [decode_batch(b) for b in stream.batches]
    cut = len(stream.batches) // 2  # the halves: the same batches for every side
    halves: dict[str, tuple[list[Any], list[Any]]] = {
        "kvevents": (stream.batches[:cut], stream.batches[cut:]),
        "dynamo": (stream.dynamo_events(0, cut), stream.dynamo_events(cut)),
        "naive": (decoded[:cut], decoded[cut:]),
    }
    n_dynamo = sum(len(h) for h in halves["dynamo"])
    sides = make_sides(radix_tree)
    row: dict[str, Any] = {
        "config": {"workers": workers, "blocks_per_worker": config.blocks_per_worker, "churn": config.churn},
        "stream": {
            "events": stream.events,
            "dynamo_events": n_dynamo,
            "batches": len(stream.batches),
            "blocks_stored": stream.blocks_stored,
            "avro_bytes": sum(map(len, stream.batches)),
            "held_worker_blocks": stream.held_worker_blocks,
            "distinct_shared_blocks": stream.distinct_shared_blocks,
            "generated_s": gen_s,
        },
        "sides": {},
    }
    print(
        f"  {workers} workers x {config.blocks_per_worker} blocks: {stream.events:,} events, "
        f"{stream.blocks_stored:,} blocks, generated in {gen_s:.1f} s",
        flush=True,
    )
    # ---- ingest alone, sides alternating within each repeat
    runs: dict[str, list[list[float]]] = {s.name: [] for s in sides}
    objs: dict[str, Any] = {}
    for _ in range(args.repeat):
        for side in sides:
            objs.pop(side.name, None)
            gc.collect()
            obj, times = timed_ingest(side, halves[side.name])
            runs[side.name].append(times)
            objs[side.name] = obj
    second_blocks = _blocks_of(decoded[cut:])
    for side in sides:
        whole = [sum(t) for t in runs[side.name]]
        second = [t[1] for t in runs[side.name]]
        med = statistics.median(whole)
        row["sides"][side.name] = {
            "ingest": {
                "seconds_median": med,
                "blocks_per_s": stream.blocks_stored / med,
                "events_per_s": (n_dynamo if side.name == "dynamo" else stream.events) / med,
                "second_half_blocks_per_s": second_blocks / statistics.median(second),
                "batch_apply_us_mean": med / len(stream.batches) * 1e6 if side.name == "kvevents" else None,
                "runs_s": whole,
            }
        }
    ours = objs.get("kvevents")
    if ours is not None and ours.held_blocks() != stream.held_worker_blocks:
        raise SystemExit(
            f"kvevents holds {ours.held_blocks()} worker-blocks, the generator {stream.held_worker_blocks}"
        )
    # ---- lookups alone
    queries = {
        size: make_fleet_queries(stream.paths, size, args.matrix_queries, seed=size * 7 + workers)
        for size in QUERY_SIZES
    }
    targets = [(side, objs[side.name]) for side in sides]
    if ours is not None and getattr(args, "baseline_core", None):
        # another build of the compiled core (e.g. main's), fed the same stream, interleaved
        # with the other sides query by query (its lookups only: ingest is bench/ingest.py's)
        base = index_with_core(load_core(args.baseline_core))
        ingest_ours(base, stream.batches)
        if base.held_blocks() != stream.held_worker_blocks:
            raise SystemExit(
                f"the baseline core holds {base.held_blocks()} worker-blocks, ours {ours.held_blocks()}"
            )
        check = [q for size in QUERY_SIZES for q in queries[size][: args.cross_check // len(QUERY_SIZES)]]
        same = sum(base.find_matches(q[0]) == ours.find_matches(q[0]) for q in check)
        row["baseline_core"] = {"path": args.baseline_core, "identical_answers": same, "queries": len(check)}
        row["sides"]["baseline"] = {}
        # right after ours, so each runs after a side that is not the other build of itself
        targets.insert(1, (Side("baseline", CacheIndex, ingest_ours, sides[0].lookup, 0), base))
    for size, qs in queries.items():
        res = lookups_interleaved(targets, qs, max(3, args.repeat))
        for name, figures in res.items():
            row["sides"][name].setdefault("lookups", {})[str(size)] = figures
    # the 64-block lookups again with the cyclic GC off during the passes (as timeit does), every
    # side alike: the naive side's allocations trigger collections that land in any side's calls
    res = lookups_interleaved(targets, queries[64], max(3, args.repeat), gc_off=True)
    for name, figures in res.items():
        row["sides"][name]["lookups_gc_off"] = {"64": figures}
    print(
        "    64-block p50/p99 us with the GC off: "
        + ", ".join(f"{name} {f['p50_us']:.1f}/{f['p99_us']:.1f}" for name, f in res.items())
        + "".join(
            f"; {name} p99 / naive's {res[name]['p99_us'] / res['naive']['p99_us']:.4f}"
            for name in ("kvevents", "baseline")
            if name in res and "naive" in res
        ),
        flush=True,
    )
    if ours is not None and len(targets) > 1:
        # what no walk escapes in this context (bench/support/index_sides.py, query_floor)
        qs, part = queries[64], next(side.query_part for side, _ in targets if side.name == "kvevents")
        others = [
            (functools.partial(side.lookup, obj), [q[side.query_part] for q in qs])
            for side, obj in targets
            if side.name not in ("kvevents", "baseline")
        ]
        row["floor_64"] = query_floor(ours, others, [q[part] for q in qs], max(3, args.repeat))
    checks = [q for size in QUERY_SIZES for q in queries[size][: args.cross_check // len(QUERY_SIZES)]]
    row["cross_check"] = cross_check(objs, checks)
    objs.clear()
    gc.collect()
    # ---- lookups from a second thread during ingest
    if "baseline" in row["sides"]:
        row["sides"]["baseline"]["during_ingest"] = {"status": "not measured for the baseline core"}
    for side in sides:
        if not side.thread_safe:
            row["sides"][side.name]["during_ingest"] = {"status": "skipped: this core is not thread-safe"}
            continue
        conc = [
            lookups_during_ingest(side, *halves[side.name], queries[64], args.lookup_rate)
            for _ in range(args.concurrent_repeat)
        ]
        gc.collect()
        figures = {k: statistics.median(c[k] for c in conc) for k in conc[0]}
        alone = row["sides"][side.name]["ingest"]["second_half_blocks_per_s"]
        row["sides"][side.name]["during_ingest"] = {
            "lookup_size": 64,
            **figures,
            "ingest_blocks_per_s": second_blocks / figures["ingest_s"],
            "ingest_rate_vs_alone": second_blocks / figures["ingest_s"] / alone,
            "runs": conc,
        }
    row["seconds"] = time.perf_counter() - started
    print(f"  {workers} workers: {row['seconds']:.0f} s", flush=True)
    return row


def _blocks_of(batches: list[Any]) -> int:
    from kvevents.schemas import KVCacheStoredData

    return sum(len(e.data.blocks) for b in batches for e in b.events if isinstance(e.data, KVCacheStoredData))


def run_matrix(args: Any, radix_tree: Any) -> dict[str, Any]:
    out: dict[str, Any] = {
        "worker_blocks_per_cell": args.matrix_worker_blocks,
        "query_sizes": list(QUERY_SIZES),
        "queries_per_size": args.matrix_queries,
        "repeats": args.repeat,
        "lookup_rate": args.lookup_rate,
        "cells": {},
    }
    for workers in args.matrix_workers:
        out["cells"][str(workers)] = run_cell(workers, args, radix_tree)
        gc.collect()
    return out
