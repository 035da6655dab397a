"""The index's cache cap over time (``BatchLimits.max_caches``): a stream of valid batches that
would take an index past it gets the offending batch rejected whole (IndexFullError, a
LimitError), the index unchanged, and batches on caches it has keep applying; both cores and
both entry points alike."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from _index_helpers import batch, created, removed, stored
from kvevents.consumer import CacheIndex, WorkerKey
from kvevents.consumer._state import SLOT_MAX
from kvevents.schemas import (
    BatchLimits,
    EventBatch,
    KVCacheEvent,
    KVCacheStoredData,
    LimitError,
    encode_batch,
)
from kvevents.schemas.limits import DEFAULT_LIMITS, MAX_CACHES, IndexFullError

RANKS = 4
CAP = 20


def _windows_batch(seq: int, windows: list[int], first_id: int, hash_base: int) -> EventBatch:
    """One Stored event per rank and window (``len(windows) * RANKS`` caches if all new)."""
    events: list[KVCacheEvent] = []
    for rank in range(RANKS):
        for k, window in enumerate(windows):
            events.append(stored(first_id + k, [hash_base + 100 * rank + k], window=window, rank=rank))
    return batch(events, seq, dp=RANKS)


def _rejected(index: CacheIndex, feed: Callable[[CacheIndex, EventBatch], None], bad: EventBatch) -> str:
    before, counters = index.to_bytes(), index.stats().counters
    with pytest.raises(IndexFullError) as info:
        feed(index, bad)
    assert isinstance(info.value, LimitError)
    assert index.to_bytes() == before and index.stats().counters == counters
    return str(info.value)


def test_a_stream_reaching_the_cap_gets_the_batch_beyond_it_rejected_whole(
    core: str, feed: Callable[[CacheIndex, EventBatch], None]
) -> None:
    index = CacheIndex(core=core, limits=BatchLimits(max_caches=CAP))
    feed(index, _windows_batch(0, [64, 128], 0, 1000))  # 8 caches
    feed(index, _windows_batch(1, [192, 256], 2, 2000))  # 16
    error = _rejected(index, feed, _windows_batch(2, [320, 384], 4, 3000))  # would be 24
    assert "max_caches" in error and "add 8" in error and "16 held" in error and str(CAP) in error
    # more events than room is left, all on caches the index has: applies
    feed(index, _windows_batch(2, [64, 256], 4, 4000))
    assert index.stats().counters["events_applied"] == 24
    # exactly to the cap: applies; one more: rejected, again with nothing changed
    feed(index, _windows_batch(3, [320], 6, 5000))
    _rejected(index, feed, batch([stored(7, [6000], window=448, rank=0)], 4, dp=RANKS))
    # a Created event retires a worker's caches; re-creating one takes no new cache
    feed(index, batch([created(7, window=64, rank=0), stored(8, [7000], window=128, rank=0)], 4, dp=RANKS))
    assert set(index.worker_stats(index.workers()[0]).windows) == {64, 128}
    # a new instance cannot take caches either, and leaves no trace of itself
    _rejected(index, feed, batch([stored(0, [8000])], 0, instance="newcomer"))
    assert len(index.workers()) == RANKS
    # Removed events name caches but never make them: not counted
    feed(index, batch([removed(0, [1]), removed(1, [2])], 0, instance="remover"))


def test_empty_batches_naming_new_instances_stop_at_the_instance_cap(
    core: str, feed: Callable[[CacheIndex, EventBatch], None]
) -> None:
    """A batch of no event still makes its instance a record (its session, its sequence): a
    stream of 27-byte empty batches under ever new instance ids grew memory and every
    checkpoint by ~400 bytes each, without bound. ``max_instances`` bounds them."""
    index = CacheIndex(core=core, limits=BatchLimits(max_instances=5))
    for k in range(5):
        feed(index, batch([], 0, instance=f"empty-{k}"))
    error = _rejected(index, feed, batch([], 0, instance="empty-5"))
    assert "max_instances" in error and "5 held" in error
    _rejected(index, feed, batch([stored(0, [1])], 0, instance="stores"))
    feed(index, batch([stored(0, [1])], 1, instance="empty-4"))  # a known instance goes on
    assert index.find_matches([1]) == {WorkerKey("empty-4", 0): 1}
    assert len(index._core.export_state().instances) == 5  # type: ignore[attr-defined]


def test_events_and_drops_naming_new_ranks_stop_at_the_worker_cap(
    core: str, feed: Callable[[CacheIndex, EventBatch], None]
) -> None:
    """Every rank an event or a ``dropped`` count names becomes a worker (a record, even
    without a cache): ``max_workers`` bounds them over the index's life, counting only the
    ranks a batch would add."""
    index = CacheIndex(core=core, limits=BatchLimits(max_workers=6))
    feed(index, batch([stored(0, [10], rank=r) for r in range(4)], 0, dp=8))
    error = _rejected(index, feed, batch([], 1, dp=8, dropped=[(r, 1) for r in range(8)]))
    assert "max_workers" in error and "add 4" in error and "4 held" in error
    feed(index, batch([removed(1, [10], rank=r) for r in range(4)], 1, dp=8, dropped=[(4, 2), (5, 0)]))
    assert len(index.workers()) == 5 and index.is_degraded(WorkerKey("i0", 4))
    feed(index, batch([stored(0, [11], rank=5)], 2, dp=8))  # the sixth
    _rejected(index, feed, batch([stored(0, [12], rank=6)], 3, dp=8))
    _rejected(index, feed, batch([stored(0, [13])], 0, instance="other"))
    feed(index, batch([stored(2, [14], rank=0), stored(1, [15], rank=5)], 3, dp=8))  # known ranks
    assert index.find_matches([14]) == {WorkerKey("i0", 0): 1}


def test_the_cap_counts_distinct_caches_once(
    core: str, feed: Callable[[CacheIndex, EventBatch], None]
) -> None:
    index = CacheIndex(core=core, limits=BatchLimits(max_caches=2))
    feed(index, batch([stored(k, [10 + k], window=64 * (1 + k % 2)) for k in range(6)], 0))
    assert index.stats().counters["events_applied"] == 6


def test_limits_survive_a_restore(core: str) -> None:
    small = BatchLimits(max_caches=1)
    index = CacheIndex(core=core, limits=small)
    index.apply(batch([stored(0, [10])], 0))
    restored = CacheIndex.from_bytes(index.to_bytes(), core=core, limits=small)
    assert restored.limits == small
    with pytest.raises(IndexFullError):
        restored.apply(batch([stored(1, [11], window=128)], 1))


def test_the_cap_is_what_the_state_format_can_number() -> None:
    assert DEFAULT_LIMITS.max_caches == MAX_CACHES == SLOT_MAX + 1
    assert DEFAULT_LIMITS.max_instances == DEFAULT_LIMITS.max_workers == MAX_CACHES
    with pytest.raises(ValueError, match="max_caches"):
        BatchLimits(max_caches=MAX_CACHES + 1)
    with pytest.raises(ValueError, match="max_caches"):
        BatchLimits(max_caches=0)


@pytest.mark.slow
def test_the_compiled_core_fills_all_2_20_caches_then_rejects_the_next_batch_whole() -> None:
    """The default cap for real (the pure core, ten times the memory, is held to the same rule at
    small caps above): 64 valid batches of 1,024 ranks x 16 windows, then one more cache (each
    rank has 1,024 window sizes by then: the per-worker cap is raised to let them)."""
    dp, windows = 1024, 16
    index = CacheIndex(core="compiled", limits=BatchLimits(max_windows_per_worker=1024))
    for seq in range(MAX_CACHES // (dp * windows)):
        events = [
            KVCacheEvent(seq * windows + k, KVCacheStoredData(None, []), seq * windows + k + 1, rank)
            for rank in range(dp)
            for k in range(windows)
        ]
        index.apply_encoded(encode_batch(EventBatch("big", events, attention_dp_size=dp, sequence=seq)))
    assert index.stats().counters["events_applied"] == MAX_CACHES
    before, counters = index.to_bytes(), index.stats().counters
    last = KVCacheEvent(10**6, KVCacheStoredData(None, []), 10**6, 0)
    for feed in (index.apply, lambda b: index.apply_encoded(encode_batch(b))):
        with pytest.raises(IndexFullError, match=f"to the {MAX_CACHES} held"):
            feed(EventBatch("big", [last], attention_dp_size=dp, sequence=64))
    assert index.to_bytes() == before and index.stats().counters == counters


def test_a_worker_past_its_window_sizes_gets_the_batch_rejected_whole(
    core: str, feed: Callable[[CacheIndex, EventBatch], None]
) -> None:
    """``max_windows_per_worker``: each window size a worker ever had costs every later event of
    it a step of the compiled core's walk (65k of them made a 66-byte batch cost 317 µs), so a
    worker past the cap gets the batch rejected whole; other workers and known windows go on."""
    index = CacheIndex(core=core, limits=BatchLimits(max_windows_per_worker=3))
    feed(index, batch([stored(k, [10 + k], window=64 * (k + 1)) for k in range(3)], 0, dp=2))
    error = _rejected(index, feed, batch([stored(3, [20], window=256)], 1, dp=2))
    assert "worker 'i0' rank 0 1 more window sizes to the 3 it has" in error
    assert "max_windows_per_worker" in error
    # rank 1 has room; a batch giving rank 0 a fourth and rank 1 a first names rank 0 only
    both = batch([stored(3, [21], window=512, rank=1), stored(3, [22], window=256)], 1, dp=2)
    assert "rank 0 1 more" in _rejected(index, feed, both)
    feed(index, batch([stored(0, [23], window=512, rank=1)], 1, dp=2))
    # a Created event retires the worker's caches; its old window sizes still count, re-creating
    # one takes no new
    feed(index, batch([created(3, window=64), stored(4, [24], window=128)], 2, dp=2))
    assert set(index.worker_stats(WorkerKey("i0", 0)).windows) == {64, 128}
    _rejected(index, feed, batch([created(5, window=1024)], 3, dp=2))
    # a new instance past it in its first batch leaves no trace of itself
    _rejected(
        index, feed, batch([stored(k, [30 + k], window=8 * (k + 1)) for k in range(4)], 0, instance="new")
    )
    assert {key.instance_id for key in index.workers()} == {"i0"}


def test_the_window_cap_is_checked_for_every_worker_of_a_batch(
    core: str, feed: Callable[[CacheIndex, EventBatch], None]
) -> None:
    """With few window sizes per batch, only a worker near the cap is looked at: one far from it
    first in the batch does not hide one near it after."""
    index = CacheIndex(core=core, limits=BatchLimits(max_windows_per_worker=6, max_windows_per_batch=2))
    for k in range(3):
        feed(
            index,
            batch([stored(2 * k + j, [10 * k + j], window=8 * (2 * k + j + 1)) for j in range(2)], k, dp=2),
        )
    feed(index, batch([stored(0, [100], window=8, rank=1)], 3, dp=2))  # rank 1 far from it: applies
    mixed = batch(
        [stored(1, [101], window=64, rank=1), stored(6, [102], window=64), stored(7, [103], window=72)],
        4,
        dp=2,
    )
    assert "rank 0 2 more window sizes to the 6 it has" in _rejected(index, feed, mixed)
