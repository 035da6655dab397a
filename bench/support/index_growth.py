"""Lookups while the index's tables grow (``bench/index.py --parts growth``): an index prefilled
to ``prefill`` distinct blocks is fed ``window`` more (crossing at least one growth of each
table, x1.5, and with the defaults one more node-id bit) while a second thread sends 64-block
lookups on a schedule. Each core in turn (this build, and ``--baseline-core`` when given), the
order alternating by repeat; latency from each lookup's scheduled time (index_sides)."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from typing import Any

from index_sides import Side, index_with_core, ingest_ours, load_core, lookups_during_ingest, median_of
from kvevents.consumer import CacheIndex
from kvevents.schemas import EventBatch, KVCacheEvent, KVCacheStoredBlockData, KVCacheStoredData, encode_batch

BLOCKS_PER_EVENT = 500
EVENTS_PER_BATCH = 4
PER_BATCH = BLOCKS_PER_EVENT * EVENTS_PER_BATCH
WORKERS = 16


def _batches(first_batch: int, count: int) -> Iterator[bytes]:
    """Batches of new blocks: batch b's events store blocks b*PER_BATCH.. (2h+1), each event a
    chain of its own on worker (rank) b % WORKERS of one instance, its own event ids."""
    for b in range(first_batch, first_batch + count):
        events = []
        for k in range(EVENTS_PER_BATCH):
            first = b * PER_BATCH + k * BLOCKS_PER_EVENT
            blocks = [
                KVCacheStoredBlockData(2 * h + 1, [h % 9973, 7])
                for h in range(first, first + BLOCKS_PER_EVENT)
            ]
            event_id = b // WORKERS * EVENTS_PER_BATCH + k
            events.append(KVCacheEvent(event_id, KVCacheStoredData(None, blocks), 64, b % WORKERS))
        yield encode_batch(EventBatch("growth", events, attention_dp_size=WORKERS, producer_id=1, sequence=b))


def _queries(prefill_batches: int, n: int) -> list[tuple[list[int]]]:
    step = max(1, prefill_batches * EVENTS_PER_BATCH // n)
    runs = []
    for e in range(0, prefill_batches * EVENTS_PER_BATCH, step):
        first = e * BLOCKS_PER_EVENT + 100
        runs.append(([2 * h + 1 for h in range(first, first + 64)],))
    return runs[:n]


def _layout(index: CacheIndex) -> dict[str, int]:
    return dict(index._core.store_layout())


def _one(name: str, new_index: Any, prefill: int, window: int, rate: float) -> dict[str, Any]:
    index = new_index()
    chunk = 50
    for start in range(0, prefill, chunk):
        ingest_ours(index, list(_batches(start, min(chunk, prefill - start))))
    items = list(_batches(prefill, window))
    gc.collect()
    before = _layout(index)
    side = Side(name, lambda index=index: index, ingest_ours, lambda obj, q: obj.find_matches(q), 0)
    result = lookups_during_ingest(side, [], items, _queries(prefill, 2000), rate)
    after = _layout(index)
    result["ingest_blocks_per_s"] = window * PER_BATCH / result["ingest_s"]
    result["store_before"], result["store_after"] = before, after
    result["table_growths"] = sum(
        after[f"{t}_table_cap"] != before[f"{t}_table_cap"] for t in ("engine", "content")
    )
    result["id_bits_added"] = after["id_bits"] - before["id_bits"]
    for key in ("rebuilds_ahead", "rebuilds_locked"):  # not in older cores
        if key in after:
            result[key] = after[key] - before.get(key, 0)
    if index.find_matches(_queries(prefill, 1)[0][0]) != {("growth", 0): 64}:
        raise SystemExit(f"{name}: the first prefilled blocks are not found")
    del index, items
    gc.collect()
    return result


def run_growth(
    prefill_blocks: int, window_blocks: int, rate: float, repeat: int, baseline_core: str
) -> dict[str, Any]:
    """Per core: the median of ``repeat`` runs' lookup latencies (p50/p99/max, microseconds) and
    missed slots, and what the store did in the window (growths, rebuilds ahead / locked)."""
    cores: list[tuple[str, Any]] = [("kvevents", lambda: CacheIndex(core="compiled"))]
    if baseline_core:
        base = load_core(baseline_core)
        cores.append(("baseline", lambda: index_with_core(base)))
    prefill, window = prefill_blocks // PER_BATCH, window_blocks // PER_BATCH
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name, _ in cores}
    for r in range(repeat):
        for name, new_index in cores if r % 2 == 0 else cores[::-1]:
            print(f"  growth: {name}, run {r + 1} of {repeat} ...", flush=True)
            runs[name].append(_one(name, new_index, prefill, window, rate))
    out: dict[str, Any] = {
        "config": {"prefill_blocks": prefill * PER_BATCH, "window_blocks": window * PER_BATCH, "rate": rate},
        "sides": {},
    }
    for name, results in runs.items():
        timing = median_of(
            [{k: float(v) for k, v in x.items() if isinstance(v, int | float)} for x in results]
        )
        out["sides"][name] = {"median": timing, "runs": results}
    return out


def print_growth(res: dict[str, Any]) -> None:
    c = res["config"]
    print(
        f"\nLookups (64 blocks, {c['rate']:.0f}/s scheduled) while {c['window_blocks']:,} blocks are fed on top "
        f"of {c['prefill_blocks']:,} (the tables grow in that window); medians of the runs"
    )
    print(
        f"  {'core':<10} {'p50 us':>9} {'p99 us':>10} {'max us':>11} {'missed':>7} {'Mblocks/s':>10}  store"
    )
    for name, side in res["sides"].items():
        m, last = side["median"], side["runs"][-1]
        store = f"{last['table_growths']} growths, +{last['id_bits_added']} id bits"
        if "rebuilds_ahead" in last:
            store += f", rebuilds ahead {last['rebuilds_ahead']} / locked {last['rebuilds_locked']}"
        print(
            f"  {name:<10} {m['p50_us']:>9.1f} {m['p99_us']:>10.1f} {m['max_us']:>11.1f} {m['missed']:>7.0f} "
            f"{m['ingest_blocks_per_s'] / 1e6:>10.2f}  {store}"
        )
