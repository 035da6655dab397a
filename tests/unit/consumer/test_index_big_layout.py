"""The compiled core past its small layout: node chunks in huge-page slabs (after 16 chunks of
2**14 nodes) and 2 MiB-aligned tables (from 8 MiB), with huge pages on and off; dropping the
index gives the memory back."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

SCRIPT = r"""
import ctypes, gc, os
from array import array
from kvevents.consumer.index import CacheIndex
from kvevents.consumer._state import IndexState, InstanceState, WindowState, WorkerState

def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

n = 1_200_000  # 74 chunks (4 slabs and more), tables of 2**21 entries (16 MiB)
engine = array("Q", range(1, 2 * n + 1, 2))
holders = array("I", [k % 3 for k in range(n)])
workers = [WorkerState("i0", r, 0, False, False, 0, None, [], 0, [WindowState(64, None)]) for r in range(3)]
state = IndexState([InstanceState("i0", 1, 0, [], 3)], workers, engine.tobytes(), engine.tobytes(),
                   bytes([1]) * n, array("I", [1] * n).tobytes(), holders.tobytes())
index = CacheIndex(core="compiled")
index._core.import_state(state)
assert index.held_blocks() == n
for k in (0, 1, 16383, 16384, 262143, 262144, 500_000, n - 1):
    assert index.find_matches([2 * k + 1]) == {("i0", k % 3): 1}, k
    assert index.find_matches_by_content([2 * k + 1]) == {("i0", k % 3): 1}, k
assert index.find_matches([2]) == {}
again = CacheIndex.from_bytes(index.to_bytes(), core="compiled")
assert again.same_state(index)
# dropping an index gives its memory back (node slabs and big tables are unmapped)
store = again.memory_bytes()
del index
gc.collect()
ctypes.CDLL("libc.so.6").malloc_trim(0)
before = rss()
del again
gc.collect()
ctypes.CDLL("libc.so.6").malloc_trim(0)
freed = before - rss()
assert freed >= 0.8 * store, (freed, store)
print("ok")
"""


@pytest.mark.parametrize("huge", ["1", "0"])
def test_a_million_nodes_are_found_and_round_trip(huge: str) -> None:
    env = {**os.environ, "KVEVENTS_INDEX_HUGEPAGES": huge}
    out = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"
