"""Producer snapshots and the Created rule after a gap, on both cores and both entry points.

A snapshot is a run of ``Created(snapshot=True)`` events (one per window size) followed by Stored
events that restore every held block. A Created run continues only while nothing is lost
between its events: after a gap (event ids jumped, drops reported, batches lost, a new producer
session) the next Created event starts a new cache generation and clears the degraded flag.
"""

from __future__ import annotations

import pytest
from _index_helpers import W0, batch, created, stored
from kvevents.consumer import CacheIndex
from kvevents.schemas import (
    EventBatch,
    KVCacheCreatedData,
    KVCacheEvent,
    decode_batch,
    encode_batch,
)
from schema_v1 import v1_message


@pytest.fixture
def index(core: str) -> CacheIndex:
    return CacheIndex(core=core)


def test_snapshot_after_dropped_events_rebuilds_the_worker_exactly(index, feed):
    feed(
        index,
        batch(
            [
                created(0, window=64),
                created(1, window=128),
                stored(2, [1, 2], window=64),
                stored(3, [7], window=128),
            ],
            0,
        ),
    )
    # events 4..9 were dropped by the producer (reported in-band), then it publishes a snapshot
    feed(
        index,
        batch(
            [
                created(10, window=64, snapshot=True),
                created(11, window=128, snapshot=True),
                stored(12, [1, 3], window=64),
                stored(13, [8], window=128),
            ],
            1,
            dropped=[(0, 6)],
        ),
    )
    assert not index.is_degraded(W0)
    assert index.find_matches([1, 3], window_size=64) == {W0: 2}
    assert index.find_matches([1, 2], window_size=64) == {W0: 1}
    assert index.find_matches([7], window_size=128) == {} and index.find_matches([8]) == {W0: 1}
    assert index.stats().counters["resyncs"] == 1


def test_snapshot_created_right_after_a_created_run_with_a_gap_still_resets(index, feed):
    """The Created run the engine sent is the last thing the index saw; a gap follows."""
    feed(index, batch([created(0, window=64), created(1, window=128)], 0))
    feed(index, batch([created(9, window=64, snapshot=True), stored(10, [5], window=64)], 1))
    stats = index.worker_stats(W0)
    assert not stats.degraded
    assert sorted(stats.windows) == [64]  # window 128 was not in the snapshot: gone
    assert index.stats().counters["resyncs"] == 1


def test_engine_created_after_a_gap_starts_a_new_generation(index, feed):
    feed(index, batch([created(0, window=64), created(1, window=128)], 0))
    feed(index, batch([created(3, window=64)], 1))  # event 2 (a Created of another window?) lost
    stats = index.worker_stats(W0)
    assert not stats.degraded and sorted(stats.windows) == [64]
    assert index.stats().counters["resyncs"] == 0


def test_a_created_run_without_a_gap_keeps_the_windows_created_before(index, feed):
    feed(index, batch([created(0, window=64)], 0))
    feed(index, batch([created(1, window=128, snapshot=True)], 1))
    assert sorted(index.worker_stats(W0).windows) == [64, 128]
    assert index.stats().counters["resyncs"] == 0  # it continued the run, it reset nothing


def test_created_of_a_new_producer_session_starts_a_new_generation(index, feed):
    feed(index, batch([created(0, window=64), created(1, window=128)], 0, pid=1))
    feed(index, batch([created(0, window=64)], 0, pid=2))  # engine restarted with one window only
    assert sorted(index.worker_stats(W0).windows) == [64]


def test_a_replayed_snapshot_changes_nothing(index, feed):
    snapshot = batch([created(4, snapshot=True), stored(5, [1, 2])], 1, dropped=[(0, 2)])
    feed(index, batch([created(0), stored(1, [9])], 0))
    feed(index, snapshot)
    before = index.to_bytes()
    feed(index, snapshot)
    assert index.to_bytes() == before and index.stats().counters["resyncs"] == 1


def test_the_fused_reader_reads_v1_bodies_without_the_snapshot_field(core, monkeypatch):
    """A topic written before schema v2 is applied by the fast path and gives the same index."""
    plain = batch([created(0), created(1, window=128), stored(2, [1, 2])], 0)
    message = v1_message(plain)
    assert decode_batch(message) == plain
    old, new = CacheIndex(core=core), CacheIndex(core=core)
    if core == "compiled":  # the fused reader itself, not the decode_batch fallback
        from kvevents.consumer import _indexcore

        monkeypatch.setattr(_indexcore, "decode_batch", None)
    old.apply_encoded(message)
    new.apply_encoded(encode_batch(plain))
    assert old.same_state(new) and old.held_blocks() == 2


@pytest.mark.parametrize("bad", [2, 0xFF])
def test_a_bad_boolean_byte_is_a_decode_error_and_applies_nothing(core, bad):
    from kvevents.schemas import DecodeError

    message = bytearray(encode_batch(EventBatch("i0", [KVCacheEvent(0, KVCacheCreatedData([3], True), 64)])))
    # ... snapshot (1), window_size 64 (zigzag 80 01), a null rank (00), the end of the events (00)
    assert bytes(message[-5:]) == b"\x01\x80\x01\x00\x00"
    message[-5] = bad
    index = CacheIndex(core=core)
    with pytest.raises(DecodeError):
        index.apply_encoded(bytes(message))
    assert index.workers() == []
