"""The compiled core's scratch after a huge batch or query: returned, not kept for the index's
life (found by a hostile-input audit: 8 MB of empty Removed events kept 56 MB, a 10**7-key
query kept the caller's list and 80 MB of keys)."""

from __future__ import annotations

import sys
from array import array

from _index_helpers import batch, removed, stored
from kvevents.consumer import CacheIndex
from kvevents.schemas import encode_batch

MIB = 1 << 20


def test_a_huge_batch_leaves_no_scratch_behind() -> None:
    index = CacheIndex(core="compiled")
    index.apply_encoded(encode_batch(batch([stored(0, [1, 2])], 0)))
    small = index.memory_bytes()
    huge = encode_batch(batch([removed(i, []) for i in range(1 << 20)], 1))  # 8 MB on the wire
    for apply in (index.apply_encoded, lambda data: index.apply_encoded_many([data, data])):
        apply(huge)
        assert index.memory_bytes() - small < 4 * MIB  # their scratch was ~56 MB
    index.apply(batch([removed(i, []) for i in range(1 << 20)], 1))
    assert index.memory_bytes() - small < 4 * MIB
    assert index.find_matches([1, 2]) != {}  # and it goes on working


def test_a_query_lets_go_of_its_list_and_of_a_huge_key_scratch() -> None:
    index = CacheIndex(core="compiled")
    index.apply_encoded(encode_batch(batch([stored(0, [1, 2, 3])], 0)))
    small = index.memory_bytes()
    query = [1, 2, 3, *range(10, 10 + (1 << 20))]
    references = sys.getrefcount(query)
    assert len(index.find_matches(query)) == 1
    assert sys.getrefcount(query) == references  # the core kept it until the next query
    assert index.memory_bytes() - small < MIB  # 8 MB of keys were kept
    index.find_matches(array("Q", query))
    assert index.memory_bytes() - small < MIB
    assert index.find_matches([1, 2]) == index.find_matches(array("Q", [1, 2]))
