"""The three indexes the bench compares, behind one small interface: kvevents' ``CacheIndex``
(fed Avro bytes), Dynamo's ``RadixTree`` (fed its JSON events) and the naive pure-Python index
(fed decoded batches); plus the timing helpers they share (lookups, lookups during ingest)."""

from __future__ import annotations

import gc
import importlib.util
import os
import statistics
import threading
import time
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from index_naive import NaiveIndex
from kvevents.consumer import CacheIndex
from kvevents.consumer.workers import WorkerKey


def load_dynamo() -> Any:
    """Dynamo's RadixTree class, or None when ai-dynamo-runtime is not installed."""
    os.environ.setdefault("DYN_LOG", "error")
    try:
        from dynamo.llm import RadixTree
    except ImportError:
        return None
    return RadixTree


def load_core(path: str) -> Any:
    """The ``IndexCore`` class of another build of the compiled core (e.g. main's
    ``consumer/_indexcore.cpython-311-x86_64-linux-gnu.so``), loaded beside this one."""
    name = "kvevents.consumer." + os.path.basename(path).split(".")[0]
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"cannot load a compiled core from {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.IndexCore


def index_with_core(core_class: Any) -> CacheIndex:
    """A ``CacheIndex`` running on ``core_class`` (a baseline build of the compiled core)."""
    index = CacheIndex(core="compiled")
    index._core = core_class(WorkerKey, None)
    for name in ("find_matches", "find_matches_by_content"):  # entry points bound on the instance
        index.__dict__.pop(name, None)
        if hasattr(index._core, name):
            index.__dict__[name] = getattr(index._core, name)
    return index


def ingest_method() -> str:
    """How kvevents is fed: ``apply_encoded_many`` when this ``CacheIndex`` has it, else one
    ``apply_encoded`` call per batch."""
    return "apply_encoded_many" if hasattr(CacheIndex, "apply_encoded_many") else "apply_encoded"


def ingest_ours(index: CacheIndex, batches: Sequence[bytes]) -> None:
    many = getattr(index, "apply_encoded_many", None)
    if many is not None:
        many(list(batches))
        return
    apply = index.apply_encoded
    for data in batches:
        apply(data)


def ingest_dynamo(tree: Any, events: Sequence[tuple[int, bytes]]) -> None:
    apply = tree.apply_event
    for worker, event in events:
        apply(worker, event)
    tree.find_matches([0])  # its helper thread has taken every event once this returns


@dataclass
class Side:
    """One index: how to build it, feed it a slice of its stream, and query it."""

    name: str
    new: Callable[[], Any]
    ingest: Callable[[Any, Sequence[Any]], None]
    lookup: Callable[[Any, Any], Any]
    query_part: int
    """Which part of a query tuple it takes: 0 engine hashes, 1 Dynamo tokens hashes."""
    thread_safe: bool = True


def make_sides(radix_tree: Any, *, with_ours: bool = True) -> list[Side]:
    sides = []
    if with_ours:
        index = CacheIndex()
        sides.append(
            Side(
                "kvevents",
                CacheIndex,
                ingest_ours,
                lambda ix, q: ix.find_matches(q),
                0,
                # the compiled core's calls hold the GIL (or are made safe by the core); the
                # pure-Python core is not safe across threads
                thread_safe=index.compiled,
            )
        )
    if radix_tree is not None:
        sides.append(Side("dynamo", radix_tree, ingest_dynamo, lambda t, q: t.find_matches(q).scores, 1))
    sides.append(
        Side("naive", NaiveIndex, lambda ix, b: ix.apply_all(b), lambda ix, q: ix.find_matches(q), 0)
    )
    return sides


def percentiles(samples_ns: list[int] | list[float]) -> dict[str, float]:
    """p50/p99/max/mean in microseconds."""
    s = sorted(samples_ns)
    if not s:
        return {
            "p50_us": float("nan"),
            "p99_us": float("nan"),
            "max_us": float("nan"),
            "mean_us": float("nan"),
        }
    return {
        "p50_us": s[len(s) // 2] / 1000,
        "p99_us": s[min(len(s) - 1, int(len(s) * 0.99))] / 1000,
        "max_us": s[-1] / 1000,
        "mean_us": statistics.fmean(s) / 1000,
    }


def median_of(runs: list[dict[str, float]]) -> dict[str, float]:
    """Each figure's median over the repeats."""
    return {k: statistics.median(r[k] for r in runs) for k in runs[0]}


def timed_ingest(side: Side, parts: Sequence[Sequence[Any]]) -> tuple[Any, list[float]]:
    """A fresh index fed every part in turn; the seconds of each."""
    obj = side.new()
    gc.collect()
    times = []
    for part in parts:
        start = time.perf_counter()
        side.ingest(obj, part)
        times.append(time.perf_counter() - start)
    return obj, times


def lookups_interleaved(
    targets: list[tuple[Side, Any]], queries: Sequence[tuple[Any, ...]], repeat: int, *, gc_off: bool = False
) -> dict[str, dict[str, Any]]:
    """Per side: p50/p99/max of every query, median over ``repeat`` passes; sides interleaved
    query by query so the machine's noise hits them alike, in reverse order every other pass (a
    side run after another finds the query's ints in cache). ``*_best_us``: the percentiles of
    each query's fastest pass (scheduling noise stripped alike for every side). ``gc_off``: the
    cyclic GC disabled during the passes, as ``timeit`` does (a collection triggered by one
    side's allocations otherwise lands in whichever call allocates next)."""
    runs: dict[str, list[dict[str, float]]] = {side.name: [] for side, _ in targets}
    best: dict[str, list[float]] = {side.name: [float("inf")] * len(queries) for side, _ in targets}
    if gc_off:
        gc.collect()
        gc.disable()
    try:
        _passes(targets, queries, repeat, runs, best)
    finally:
        if gc_off:
            gc.enable()
    out = {}
    for name, r in runs.items():
        b = percentiles(best[name])
        out[name] = {
            **median_of(r),
            "repeats": len(r),
            "samples_per_pass": len(queries),
            "p50_best_us": b["p50_us"],
            "p99_best_us": b["p99_us"],
        }
    return out


def _passes(
    targets: list[tuple[Side, Any]],
    queries: Sequence[tuple[Any, ...]],
    repeat: int,
    runs: dict[str, list[dict[str, float]]],
    best: dict[str, list[float]],
) -> None:
    clock = time.perf_counter_ns
    for rep in range(repeat):
        samples: dict[str, list[int]] = {side.name: [] for side, _ in targets}
        order = targets if rep % 2 == 0 else targets[::-1]
        for i, q in enumerate(queries):
            for side, obj in order:
                arg = q[side.query_part]
                lookup = side.lookup
                t0 = clock()
                lookup(obj, arg)
                elapsed = clock() - t0
                samples[side.name].append(elapsed)
                if elapsed < best[side.name][i]:
                    best[side.name][i] = elapsed
        for name, s in samples.items():
            runs[name].append(percentiles(s))


def query_floor(
    index: CacheIndex, others: list[tuple[Any, list[Any]]], engine: list[list[int]], repeat: int
) -> dict[str, dict[str, float]]:
    """Two parts of find_matches that do not depend on the index's walk, in ``latencies``'
    context: reading the query's ints (as find_matches reads them, prefetched a few groups
    ahead: the compiled core's ``read_query_keys``; ``array('Q', query)`` on another core) and
    copying a dict the size of kvevents' answer; each timed right after the other sides' calls
    on the previous query (as find_matches is), medians of ``repeat`` passes; and find_matches
    itself the same way."""
    answers = [index.find_matches(q) for q in engine]
    core = getattr(index, "_core", None)
    read = core.read_query_keys if hasattr(core, "read_query_keys") else lambda q: array("Q", q)
    probes: dict[str, Any] = {
        "find_matches": lambda i: index.find_matches(engine[i]),
        "read_query_ints": lambda i: read(engine[i]),
        "copy_answer_sized_dict": lambda i: answers[i].copy(),
    }
    clock = time.perf_counter_ns
    out = {}
    for name, probe in probes.items():
        runs = []
        for _ in range(repeat):
            samples = []
            for i in range(len(engine)):
                for fn, args in others:
                    fn(args[i - 1])
                t0 = clock()
                probe(i)
                samples.append(clock() - t0)
            runs.append(percentiles(samples))
        out[name] = median_of(runs)
    return out


def lookups_during_ingest(
    side: Side, prefill: Sequence[Any], items: Sequence[Any], queries: Sequence[Any], rate: float
) -> dict[str, Any]:
    """A fresh index fed ``prefill``; then one thread ingests ``items`` while another sends
    lookups on a fixed schedule, ``rate`` per second. Each lookup's latency runs from its
    scheduled time to its answer, so waiting for the GIL (behind a batch) counts; a slot that
    has passed when the previous lookup returns is skipped (counted as ``missed``), so one
    stall is not counted again in every later lookup. Also the ingest's seconds."""
    obj = side.new()
    side.ingest(obj, prefill)
    gc.collect()
    stop, started = threading.Event(), threading.Event()
    latencies: list[int] = []
    missed = [0]
    args = [q[side.query_part] for q in queries]
    lookup = side.lookup
    interval = int(1e9 / rate)

    def looker() -> None:
        clock, n, i = time.perf_counter_ns, len(args), 0
        due = clock() + interval
        started.set()
        while not stop.is_set():
            late = clock() - due
            if late > 0:
                skip = late // interval + 1
                missed[0] += skip
                due += skip * interval
            time.sleep(max(0, due - clock()) / 1e9)
            lookup(obj, args[i % n])
            latencies.append(clock() - due)
            i += 1
            due += interval

    thread = threading.Thread(target=looker, name=f"lookups-{side.name}")
    thread.start()
    started.wait()
    start = time.perf_counter()
    side.ingest(obj, items)
    elapsed = time.perf_counter() - start
    stop.set()
    thread.join()
    return {
        "ingest_s": elapsed,
        "lookups": len(latencies),
        "missed": missed[0],
        "lookups_per_s": len(latencies) / elapsed if elapsed else None,
        "scheduled_per_s": rate,
        **percentiles(latencies),
    }
