"""Ingest past the small layout (16 chunks of 2**14 nodes): between batches the writer maps
the slab chunks of the next node ids under the index lock and faults their pages in without
it (``store_map_ahead`` / ``store_fault_ahead`` in ``_nodestore.pxd``). The index it builds is
the one it would build otherwise: every block found, node ids reused from the free list, the
state round-trips, with huge pages on and off, one or two ingest threads, a reader running."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

SCRIPT = r"""
import threading
from kvevents.consumer.index import CacheIndex
from kvevents.schemas import (EventBatch, KVCacheEvent, KVCacheRemovedData, KVCacheStoredBlockData,
                              KVCacheStoredData, encode_batch)

PER_EVENT, EVENTS = 1000, 4

def stored(eid, first, n):
    blocks = [KVCacheStoredBlockData(2 * h + 1, [h % 50000, 7]) for h in range(first, first + n)]
    return KVCacheEvent(eid, KVCacheStoredData(None, blocks), 64, 0)

def batches(seq0, eid0, first, n_batches, per_batch=EVENTS):
    out = []
    for b in range(n_batches):
        events = [stored(eid0 + b * per_batch + k, first + (b * per_batch + k) * PER_EVENT, PER_EVENT)
                  for k in range(per_batch)]
        out.append(encode_batch(EventBatch("i0", events, attention_dp_size=1, producer_id=7,
                                           sequence=seq0 + b)))
    return out

index = CacheIndex(core="compiled")
stop = threading.Event()
errors = []

def reader():
    while not stop.is_set():
        try:
            got = index.find_matches([1, 3, 5])
            assert got in ({}, {("i0", 0): 1}, {("i0", 0): 2}, {("i0", 0): 3}), got
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)
            return

thread = threading.Thread(target=reader)
thread.start()
n1 = 100 * EVENTS * PER_EVENT  # 400k nodes: 25 chunks, past the first 16 into two slabs
assert index.apply_encoded_many(batches(0, 0, 0, 100)) == 100
assert index.held_blocks() == n1
# remove the first 50k blocks (their node ids go to the free list), then store 150k new ones
gone = [2 * h + 1 for h in range(50_000)]
rm = KVCacheEvent(400, KVCacheRemovedData(gone), 64, 0)
index.apply_encoded(encode_batch(EventBatch("i0", [rm], attention_dp_size=1, producer_id=7, sequence=100)))
# one batch of 200k new blocks (150k past the free ids: more than the 65,536 node ids faulted
# ahead, so node_top passes the faulted ones mid-page), then 18 of 4k
index.apply_encoded_many(batches(101, 401, n1, 1, 200))
index.apply_encoded_many(batches(102, 601, n1 + 200 * PER_EVENT, 18))
n2 = n1 + 272 * PER_EVENT
stop.set()
thread.join()
assert not errors, errors
assert index.held_blocks() == n2 - 50_000
assert index.stats().distinct_blocks == n2 - 50_000
for h in (0, 49_999):
    assert index.find_matches([2 * h + 1]) == {}, h
for h in (50_000, 262_143, 262_144, 262_145, 327_680, n1 - 1, n1, n1 + 65_535, n1 + 65_536, n2 - 1):
    assert index.find_matches([2 * h + 1]) == {("i0", 0): 1}, h
    assert index.find_matches([2 * h + 1, 2 * h + 3]) == {("i0", 0): 1 if h == n2 - 1 else 2}, h
assert index.find_matches([2 * n2 + 1]) == {}
for first in range(50_000, n2, PER_EVENT):  # every block, an event's run at a time
    run = [2 * h + 1 for h in range(first, first + PER_EVENT)]
    assert index.find_matches(run) == {("i0", 0): PER_EVENT}, first
layout = index._core.store_layout()
assert layout["node_top"] == n2 - 50_000, layout  # the freed ids were used again first
assert layout["engine_table_count"] == n2 - 50_000, layout
assert layout["content_table_count"] == 50_000, layout  # one entry per content: tokens [h % 50000, 7]
checked = index._core.check_tables()
assert checked["content_chains"] == {"wrong": 0, "longest": 13}, checked  # 622,000 blocks over 50,000
assert layout["chunks"] << 14 >= layout["node_top"] and layout["id_bits"] == 20, layout
again = CacheIndex.from_bytes(index.to_bytes(), core="compiled")
assert again.same_state(index)
print("ok")
"""


@pytest.mark.parametrize(("huge", "threads"), [("1", "2"), ("1", "1"), ("0", "2")])
def test_ingest_past_the_small_layout_builds_the_same_index(huge: str, threads: str) -> None:
    env = {**os.environ, "KVEVENTS_INDEX_HUGEPAGES": huge, "KVEVENTS_INGEST_THREADS": threads}
    out = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"
