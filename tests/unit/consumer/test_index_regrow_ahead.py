"""The tables grow (and node ids gain bits) before a batch needs it, built without the index
lock and swapped in under it (``store_regrow_build`` / ``store_regrow_swap`` in
``_storegrow.pxd``), the holder pool likewise: no table is rebuilt and the pool is not moved
inside an event, for a stream of small batches or one batch of 120k new blocks, and the index
is the one it would be otherwise (with a reader running, huge pages on and off)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

SCRIPT = r"""
import sys, threading
from kvevents.consumer.index import CacheIndex
from kvevents.schemas import (EventBatch, KVCacheEvent, KVCacheRemovedData, KVCacheStoredBlockData,
                              KVCacheStoredData, encode_batch)

BIG_BATCH = sys.argv[1] == "big"
PER_EVENT = 500

def block(h):
    return 2 * h + 1

def batch(seq, eid, first, events, instance="i0", priorities=1):
    out = []
    for k in range(events):
        start = first + k * PER_EVENT
        blocks = [KVCacheStoredBlockData(block(h), [h % 9973, 7], priority=h % priorities)
                  for h in range(start, start + PER_EVENT)]
        out.append(KVCacheEvent(eid + k, KVCacheStoredData(None, blocks), 64, 0))
    return encode_batch(EventBatch(instance, out, attention_dp_size=1, producer_id=7, sequence=seq))

index = CacheIndex(core="compiled")
stop = threading.Event()
errors, answers = [], [0]

def reader():
    probe = [block(h) for h in range(8)]
    while not stop.is_set():
        try:
            got = index.find_matches(probe)
            assert got in ({}, {("i0", 0): 8}), got
            answers[0] += 1
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)
            return

thread = threading.Thread(target=reader)
thread.start()
# 300k blocks in batches of 2 events x 500 blocks: tables 1,024 -> 562k entries, node ids 16 -> 19 bits
batches = [batch(b, 2 * b, 1000 * b, 2) for b in range(300)]
assert index.apply_encoded_many(batches) == 300
seq, eid, first = 300, 600, 300_000
if BIG_BATCH:  # 120k new blocks in one batch: more than the room made ahead of the counts
    assert index.apply_encoded_many([batch(seq, eid, first, 240)]) == 1
    seq, eid, first = seq + 1, eid + 240, first + 120_000
# remove half of the first 100k, then store more: ids reused, the tables still right
gone = [block(h) for h in range(0, 100_000, 2)]
rm = KVCacheEvent(eid, KVCacheRemovedData(gone), 64, 0)
index.apply_encoded(encode_batch(EventBatch("i0", [rm], attention_dp_size=1, producer_id=7, sequence=seq)))
more = [batch(seq + 1 + b, eid + 1 + 2 * b, first + 1000 * b, 2) for b in range(100)]
assert index.apply_encoded_many(more) == 100
total = first + 100_000
# a second instance stores blocks 100k..250k again: 150k nodes with two holders (the pool),
# every block's list unlike the one before (priorities alternate), so each has its own run
twins = [batch(b, 2 * b, 100_000 + 1000 * b, 2, "i1", priorities=2) for b in range(150)]
assert index.apply_encoded_many(twins) == 150
stop.set()
thread.join()
assert not errors, errors
assert answers[0] > 0
assert index.held_blocks() == total - 50_000 + 150_000
for h in range(0, total, 997):
    want = {} if (h < 100_000 and h % 2 == 0) else {("i0", 0): 1}
    if 100_000 <= h < 250_000:
        want[("i1", 0)] = 1
    assert index.find_matches([block(h)]) == want, h
for start in range(100_000, total, PER_EVENT):
    run = [block(h) for h in range(start, start + PER_EVENT)]
    want = {("i0", 0): PER_EVENT}
    if start < 250_000:
        want[("i1", 0)] = PER_EVENT
    assert index.find_matches(run) == want, start
layout = index._core.store_layout()
assert layout["engine_table_count"] == layout["content_table_count"] == total - 50_000, layout
assert layout["engine_table_count"] * 5 <= layout["engine_table_cap"] * 4, layout
assert layout["node_top"] < 1 << layout["id_bits"], layout
assert layout["rebuilds_ahead"] >= 20, layout
assert layout["rebuilds_locked"] == 0, layout
assert layout["pool_words"] >= 2 * 150_000 and layout["pool_grown_ahead"] >= 1, layout
assert layout["holder_runs"] == layout["holder_run_refs"] == 150_000, layout
assert layout["pool_grown_locked"] == 0, layout
again = CacheIndex.from_bytes(index.to_bytes(), core="compiled")
assert again.same_state(index)
print("ok", layout["rebuilds_ahead"], layout["rebuilds_locked"])
"""


@pytest.mark.parametrize("huge", ["1", "0"])
@pytest.mark.parametrize("shape", ["small", "big"])
def test_tables_grow_between_batches_and_the_index_is_the_same(huge: str, shape: str) -> None:
    env = {**os.environ, "KVEVENTS_INDEX_HUGEPAGES": huge}
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, shape], env=env, capture_output=True, text=True, timeout=240
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("ok "), out.stdout


def test_a_snapshot_window_grows_the_tables_before_it_is_stored() -> None:
    """load_worker_snapshot of a 60k-block window into an index of 1k blocks: the tables grow
    for all of it first (without the GIL), none inside a store, and the worker's blocks are the
    pure-Python core's."""
    from _index_helpers import batch, block, stored
    from kvevents.consumer.index import CacheIndex
    from kvevents.schemas import KVCacheStoredData, encode_batch

    first = encode_batch(batch([stored(1, list(range(1, 1001)))], 0))
    window = [KVCacheStoredData(None, [block(h) for h in range(10**6, 10**6 + 60_000)])]
    compiled, oracle = CacheIndex(core="compiled"), CacheIndex(core="python")
    for index in (compiled, oracle):
        index.apply_encoded(first)
        index.load_worker_snapshot(("i0", 1), {64: window}, last_event_id=5)  # type: ignore[arg-type]
    layout = compiled._core.store_layout()  # type: ignore[attr-defined]
    assert layout["rebuilds_ahead"] >= 1 and layout["rebuilds_locked"] == 0, layout
    assert compiled.to_bytes() == oracle.to_bytes()
