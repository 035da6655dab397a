"""CacheIndex.apply_encoded_many: apply_encoded on each batch in one call, on both cores."""

from __future__ import annotations

import pytest
from _index_helpers import batch, created, stored
from kvevents.consumer.index import CacheIndex
from kvevents.schemas import DecodeError, encode_batch


def test_applies_every_batch_in_order_like_apply_encoded(core: str) -> None:
    bodies = [encode_batch(batch([created(0)], 0)), encode_batch(batch([stored(1, [1, 2, 3])], 1))]
    bodies.append(encode_batch(batch([stored(2, [4], parent=3)], 2)))
    many, one = CacheIndex(core=core), CacheIndex(core=core)
    assert many.apply_encoded_many(bodies) == 3
    for body in bodies:
        one.apply_encoded(body)
    assert many.same_state(one)
    assert many.find_matches([1, 2, 3, 4]) == {("i0", 0): 4}


def test_stops_at_the_first_bad_batch_and_keeps_the_ones_before(core: str) -> None:
    good = [encode_batch(batch([created(0)], 0)), encode_batch(batch([stored(1, [1, 2])], 1))]
    bad = good[1][:-3]  # truncated Avro
    later = encode_batch(batch([stored(2, [3], parent=2)], 2))
    index = CacheIndex(core=core)
    with pytest.raises(DecodeError) as info:
        index.apply_encoded_many([good[0], good[1], bad, later])
    assert any("batch 2" in note for note in info.value.__notes__)
    before = CacheIndex(core=core)
    before.apply_encoded_many(good)
    assert index.same_state(before)  # the first two applied, the bad one and the rest not
    assert index.apply_encoded_many([later]) == 1  # the caller resumes after the bad one
    assert index.find_matches([1, 2, 3]) == {("i0", 0): 3}
