"""kvevents alone at the issue's scale (256 workers x 100k blocks each by default, 25.6M
worker-blocks), in a child process of its own so its RSS is the index's: the fleet is written
instance by instance (``index_fleet.py``) and fed as Avro bytes, only the feeding timed; the
last instances are fed while a second thread sends 64-block lookups on a schedule; then lookups alone (1, 64,
512 blocks) and memory (RSS delta after the stream's buffers are freed, and the core's own
estimate). Dynamo and the naive index would take minutes here: they are measured in the matrix.
With ``baseline_core`` (another build of the compiled core, e.g. main's), the same fleet is
generated again into a second index on that core once memory is measured, and the lookups run
on both, interleaved query by query: a side-by-side in one process.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import itertools
import os
import threading
import time
from collections.abc import Callable
from functools import partial
from typing import Any

from index_fleet import Fleet, FleetConfig, fleet_instance_id, make_fleet_queries
from index_matrix import QUERY_SIZES
from index_sides import (
    Side,
    index_with_core,
    ingest_method,
    ingest_ours,
    load_core,
    lookups_during_ingest,
    lookups_interleaved,
    make_sides,
)
from kvevents.consumer import CacheIndex, WorkerKey
from kvevents.schemas import EventBatch, KVCacheCreatedData, KVCacheEvent


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _trim() -> None:
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):  # not glibc: RSS keeps what malloc holds
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def _baseline_index(config: FleetConfig, tail: int, core_path: str) -> tuple[CacheIndex, float]:
    """The same fleet (generated again: it is seeded) fed to an index on another core build."""
    index = index_with_core(load_core(core_path))
    fleet, n, seconds = Fleet(config), config.instances, 0.0
    for i in range(n):
        part = fleet.instance(i, sample_paths=max(8, 4096 // n) if i < n - tail else 8)
        t0 = time.perf_counter()
        ingest_ours(index, part.batches)
        seconds += time.perf_counter() - t0
        del part
    return index, seconds


def _store_layout(index: CacheIndex) -> dict[str, int] | None:
    layout = getattr(index._core, "store_layout", None)  # not in older cores
    return layout() if layout is not None else None


def _clears(before: dict[str, int] | None, after: dict[str, int] | None) -> dict[str, int]:
    """The caches cleared from a plan made before the lock, and by a scan under it."""
    if before is None or after is None or "clears_planned" not in after:
        return {}
    return {
        k: after[k] - before[k] for k in ("clears_planned", "clears_scanned", "clears_listed") if k in after
    }


def _store_changes(before: dict[str, int] | None, after: dict[str, int] | None) -> dict[str, Any] | None:
    """What the block store did while the lookups ran: each table whose capacity changed was
    rebuilt (grown) once, each new node-id bit rebuilt both tables; every rebuild is one pass
    over all nodes, made ahead without the index lock or (older cores; a batch that outgrew
    the room made ahead) inside one event, holding it (no lookup runs meanwhile)."""
    if before is None or after is None:
        return None
    grown = sum(after[f"{t}_table_cap"] != before[f"{t}_table_cap"] for t in ("engine", "content"))
    id_bits = after["id_bits"] - before["id_bits"]
    where = {k: after[k] - before[k] for k in ("rebuilds_ahead", "rebuilds_locked") if k in after}
    return {
        "before": before,
        "after": after,
        "table_growths": grown,
        "id_bit_rebuilds": id_bits,
        "rebuilds": grown + 2 * id_bits,
        **where,
        "engine_table_load": after["engine_table_count"] / after["engine_table_cap"],
        "ids_to_next_bit": (1 << after["id_bits"]) - 1 - after["node_top"],
    }


def _restart_batch(config: FleetConfig, inst: int) -> EventBatch:
    """Instance ``inst``'s rank 0 restarts: a Created event (its cache starts empty)."""
    created = KVCacheCreatedData([config.blocks_per_worker], False)
    return EventBatch(
        fleet_instance_id(inst),
        [KVCacheEvent(1 << 40, created, config.window_size, 0)],
        attention_dp_size=config.dp_size,
        producer_id=inst + 1,
        sequence=1 << 40,
    )


def worker_restart_stall(
    indexes: dict[str, CacheIndex], config: FleetConfig, instances: int, queries: list[list[int]]
) -> dict[str, Any]:
    """What a worker's restart (a Created event) costs the writer, and how long lookups wait
    meanwhile (``_with_lookups``); then the same for ``reset_worker`` (liveness: an instance
    that closed). Three workers per index and way (the first instance's, a middle one's, the
    last one's; rank 0 restarts, rank 1 is reset), after the lookups were measured. The core
    finds a cache's blocks by a scan of every node: this core before it takes the index lock
    (docs/INDEX.md "Threads"), the cores before it under the lock (reset_worker: holding the GIL).
    Last, a checkpoint's export (``to_bytes``), which this core reads without the index lock."""
    picks = (0, instances // 2, instances - 1)
    out: dict[str, Any] = {}
    resets: dict[str, Any] = {}
    for name, index in indexes.items():
        out[name] = [
            _with_lookups(index, partial(index.apply, _restart_batch(config, i)), queries) for i in picks
        ]
        if config.dp_size > 1:
            keys = [WorkerKey(fleet_instance_id(i), 1) for i in picks]
            resets[name] = [_with_lookups(index, partial(index.reset_worker, k), queries) for k in keys]
    # a checkpoint's export (to_bytes) while lookups run: this core reads without the index
    # lock; the cores before it held the lock (and the GIL) for all of it
    exports = {name: _with_lookups(index, index.to_bytes, queries) for name, index in indexes.items()}
    first = next(iter(indexes.values()))
    return {
        "distinct_blocks": first.stats().distinct_blocks,
        "runs": out["kvevents"],
        "by_core": out,
        "resets": resets,
        "to_bytes": exports,
    }


def _with_lookups(index: CacheIndex, call: Callable[[], object], queries: list[list[int]]) -> dict[str, Any]:
    """Call ``call`` (a restart, a reset, an export) while a second thread runs 64-block
    lookups back to back; the wait is the longest time between two lookups' ends around it (a
    lookup blocked on the GIL or the index lock, before or inside ``find_matches``). The cyclic GC is off meanwhile: a full
    collection of the bench's millions of path ints is no wait on the index."""
    held = index.held_blocks()
    ends: list[float] = []
    stop = threading.Event()

    def reader() -> None:
        k = 0
        while not stop.is_set():
            index.find_matches(queries[k % len(queries)])
            ends.append(time.perf_counter())
            k += 1

    before = _store_layout(index)
    gc.collect()
    gc.disable()
    thread = threading.Thread(target=reader)
    thread.start()
    try:
        time.sleep(0.05)
        t0 = time.perf_counter()
        call()
        t1 = time.perf_counter()
        time.sleep(0.01)
    finally:
        stop.set()
        thread.join()
        gc.enable()
    gaps = [b - a for a, b in itertools.pairwise(ends) if b >= t0 and a <= t1]
    return {
        "ms": (t1 - t0) * 1e3,
        "blocks_dropped": held - index.held_blocks(),
        "lookups_during": sum(t0 <= b <= t1 for b in ends),
        "lookup_max_wait_ms": max(gaps, default=float("nan")) * 1e3,
        **_clears(before, _store_layout(index)),
    }


def _ingest_instances(
    index: CacheIndex, fleet: Fleet, count: int
) -> tuple[dict[str, Any], list[tuple[list[int], list[int]]], int]:
    """Feed the fleet's first ``count`` instances, each generated then fed (only the feeding
    timed): the figures, the sampled query paths, the worker-blocks held."""
    n = fleet.c.instances
    paths: list[tuple[list[int], list[int]]] = []
    apply_s = apply_cpu = gen_s = 0.0
    blocks = events = batches = held = 0
    for i in range(count):
        t0 = time.perf_counter()
        part = fleet.instance(i, sample_paths=max(8, 4096 // n))
        gen_s += time.perf_counter() - t0
        gc.collect()
        t0, c0 = time.perf_counter(), time.process_time()
        ingest_ours(index, part.batches)
        apply_s += time.perf_counter() - t0
        apply_cpu += time.process_time() - c0
        blocks, events, batches = (
            blocks + part.blocks_stored,
            events + part.events,
            batches + len(part.batches),
        )
        held += part.held_worker_blocks
        paths += part.paths
        del part
    ingest = {
        "instances": count,
        "blocks": blocks,
        "events": events,
        "batches": batches,
        "seconds": apply_s,
        "blocks_per_s": blocks / apply_s if apply_s else None,
        "cpu_seconds": apply_cpu,
        "blocks_per_cpu_s": blocks / apply_cpu if apply_cpu else None,
        "events_per_s": events / apply_s if apply_s else None,
        "batch_apply_us_mean": apply_s / batches * 1e6 if batches else None,
        "generated_s": gen_s,
        "method": ingest_method(),
        "ingest_threads": ingest_threads(),
    }
    return ingest, paths, held


def ingest_threads() -> int:
    """The compiled core's ingest threads (``KVEVENTS_INGEST_THREADS``, read at its import)."""
    return int(os.environ.get("KVEVENTS_INGEST_THREADS", "1"))


def run_big_ingest(workers: int, blocks_per_worker: int, concurrent_tail: int) -> dict[str, Any]:
    """Only ``run_big``'s ingest figures, on the same instances (run in a child process started
    with ``KVEVENTS_INGEST_THREADS=2``: both cores)."""
    config = FleetConfig(workers=workers, blocks_per_worker=blocks_per_worker)
    n = config.instances
    tail = min(max(1, concurrent_tail), n - 1) if n > 1 else 0
    index = CacheIndex()
    ingest, _, held = _ingest_instances(index, Fleet(config), n - tail)
    if index.held_blocks() != held:
        raise SystemExit(f"kvevents holds {index.held_blocks()} worker-blocks, the generator {held}")
    return ingest


def run_big(
    workers: int,
    blocks_per_worker: int,
    queries: int,
    repeat: int,
    concurrent_tail: int,
    lookup_rate: float,
    baseline_core: str | None = None,
) -> dict[str, Any]:
    config = FleetConfig(workers=workers, blocks_per_worker=blocks_per_worker)
    fleet = Fleet(config)
    n = config.instances
    tail = min(max(1, concurrent_tail), n - 1) if n > 1 else 0
    _trim()
    base_rss = rss_bytes()
    index = CacheIndex()
    ingest, paths, held = _ingest_instances(index, fleet, n - tail)
    gen_s = ingest["generated_s"]
    during: dict[str, Any] = {"status": "skipped: one instance only"}
    if tail:
        t0 = time.perf_counter()
        rest = [fleet.instance(i, sample_paths=8) for i in range(n - tail, n)]
        gen_s += time.perf_counter() - t0
        items = [b for part in rest for b in part.batches]
        tail_blocks = sum(p.blocks_stored for p in rest)
        held += sum(p.held_worker_blocks for p in rest)
        side = make_sides(None)[0]
        if side.thread_safe:
            q64 = make_fleet_queries(paths, 64, queries, seed=64)
            side.new = lambda index=index: index  # feed the index built so far
            before = _store_layout(index)
            during = lookups_during_ingest(side, [], items, q64, lookup_rate)
            during["store"] = _store_changes(before, _store_layout(index))
            during["ingest_blocks_per_s"] = tail_blocks / during["ingest_s"]
            during["ingest_blocks"] = tail_blocks
            during["lookup_size"] = 64
        else:
            ingest_ours(index, items)
            during = {"status": "skipped: the pure-Python core is not thread-safe"}
        del rest, items
    if index.held_blocks() != held:
        raise SystemExit(f"kvevents holds {index.held_blocks()} worker-blocks, the generator {held}")
    del fleet
    _trim()
    rss_delta = rss_bytes() - base_rss
    memory = {
        "held_worker_blocks": held,
        "distinct_blocks": index.stats().distinct_blocks,
        "rss_delta_bytes": rss_delta,
        "rss_bytes_per_worker_block": rss_delta / held,
        "estimate_bytes_per_worker_block": index.memory_bytes() / held,
    }
    side = make_sides(None)[0]
    targets: list[tuple[Side, Any]] = [(side, index)]
    baseline: dict[str, Any] | None = None
    if baseline_core:
        base_index, base_s = _baseline_index(config, tail, baseline_core)
        if base_index.held_blocks() != held:
            raise SystemExit(f"the baseline core holds {base_index.held_blocks()} worker-blocks, ours {held}")
        targets.append((Side("baseline", CacheIndex, ingest_ours, side.lookup, 0), base_index))
        baseline = {"core": baseline_core, "ingest_s": base_s, "lookups": {}, "ratios": {}}
    lookups = {}
    for size in QUERY_SIZES:
        qs = make_fleet_queries(paths, size, queries, seed=size)
        res = lookups_interleaved(targets, qs, repeat)
        lookups[str(size)] = res["kvevents"]
        if baseline is not None:
            baseline["lookups"][str(size)] = b = res["baseline"]
            same = sum(index.find_matches(q[0]) == targets[1][1].find_matches(q[0]) for q in qs)
            baseline["ratios"][str(size)] = {
                **{k: res["kvevents"][k] / b[k] for k in ("p50_us", "p99_us", "p50_best_us", "p99_best_us")},
                "identical_answers": same,
                "queries": len(qs),
            }
    restart_queries = [q for q, _ in make_fleet_queries(paths, 64, 200, seed=6400)]
    restart = worker_restart_stall(
        {"kvevents": index, **({"baseline": targets[1][1]} if baseline is not None else {})},
        config,
        n,
        restart_queries,
    )
    del targets  # the indexes are dropped below, each alone
    # The RSS delta above also holds what the bench keeps beside the index (the sampled query
    # paths: Python ints); what dropping the index gives back is the index's alone.
    del qs
    if baseline is not None:
        del base_index
    _trim()
    rss_with = rss_bytes()
    del index, side
    _trim()
    memory["rss_freed_bytes"] = rss_with - rss_bytes()
    memory["rss_freed_bytes_per_worker_block"] = memory["rss_freed_bytes"] / held
    return {
        "config": {"workers": workers, "blocks_per_worker": blocks_per_worker, "churn": config.churn},
        "ingest": ingest,
        "during_ingest": during,
        "lookups": lookups,
        "baseline_core": baseline,
        "worker_restart": restart,
        "memory": memory,
        "loadavg": os.getloadavg(),
    }
