"""The compiled core's query shortcuts give the pure-Python core's answers: the next-node guess
(a freed node, a reused id, a chain broken across events), answer templates with workers that
hold several window caches, and ``find_matches`` bound straight on the index."""

from __future__ import annotations

import random
from array import array

import pytest
from _index_helpers import batch, created, removed, stored
from kvevents.consumer import CacheIndex
from kvevents.schemas import EventBatch, KVCacheEvent, KVCacheStoredBlockData, KVCacheStoredData


def _both(batches: list[EventBatch]) -> tuple[CacheIndex, CacheIndex]:
    compiled, pure = CacheIndex(core="compiled"), CacheIndex(core="python")
    for b in batches:
        compiled.apply(b)
        pure.apply(b)
    return compiled, pure


def test_next_node_guess_after_a_removed_block_a_reused_node_and_a_chain_across_events() -> None:
    chain = list(range(1, 11))
    steps = [
        batch([created(0), stored(1, chain)], 0),
        batch([removed(2, [5])], 1),  # a hole: block 5's node is freed
        batch([stored(3, [999])], 2),  # ... and its id reused by another hash
        batch([stored(4, [5], parent=4)], 3),  # block 5 again, in another node, out of sequence
        batch([stored(5, [11, 12], parent=10)], 4),  # the chain continues in a later event
    ]
    queries = [chain, [*chain, 11, 12], [999], [4, 5, 6], [5, 6, 7], [1, 2, 999], chain[::-1]]
    seen = []
    compiled, pure = CacheIndex(core="compiled"), CacheIndex(core="python")
    for b in steps:
        compiled.apply(b)
        pure.apply(b)
        for q in queries:
            assert compiled.find_matches(q) == pure.find_matches(q), (b.sequence, q)
        seen.append(max(compiled.find_matches([*chain, 11, 12]).values(), default=0))
    assert seen == [10, 4, 4, 10, 12]


def test_templates_with_workers_holding_several_window_caches() -> None:
    """40 workers share a prefix (answers of 32+ workers come from templates); some also hold it
    in a second window cache, longer: each worker's answer is its best window."""
    prefix = list(range(100, 108))
    batches = []
    for w in range(40):
        events = [created(0, window=64), stored(1, prefix[:6], window=64)]
        if w % 5 == 0:
            events += [created(2, window=128), stored(3, prefix, window=128)]
        batches.append(batch(events, 0, f"w{w:02}"))
    compiled, pure = _both(batches)
    for q in (prefix, prefix[:6], prefix[:3], [*prefix, 1]):
        for window in (None, 64, 128):
            assert compiled.find_matches(q, window) == pure.find_matches(q, window), (q, window)
    assert sorted(set(compiled.find_matches(prefix).values())) == [6, 8]
    restored = CacheIndex.from_bytes(compiled.to_bytes(), core="compiled")  # windows counted again
    assert restored.find_matches(prefix) == pure.find_matches(prefix)
    # a new cache generation drops the second windows: back to one window per worker
    later = [
        batch([created(4, window=64), stored(5, prefix[:7], window=64)], 1, f"w{w:02}")
        for w in range(0, 40, 5)
    ]
    for b in later:
        compiled.apply(b)
        pure.apply(b)
    for q in (prefix, prefix[:7], prefix[:2]):
        assert compiled.find_matches(q) == pure.find_matches(q)
    assert sorted(set(compiled.find_matches(prefix).values())) == [6, 7]


def test_find_matches_is_bound_on_the_index_with_the_same_parameters() -> None:
    compiled, pure = _both([batch([created(0), stored(1, [1, 2, 3], level=1)], 0)])
    for index in (compiled, pure):
        assert index.find_matches(block_hashes=[1, 2, 3], window_size=None, max_cache_level=1) == {
            ("i0", 0): 3
        }
        assert index.find_matches([1, 2], max_cache_level=0) == {}
        assert index.find_matches_by_content(content_hashes=index.content_hashes([], 4)) == {}
        with pytest.raises(ValueError, match="max_cache_level must be >= 0"):
            index.find_matches([1], max_cache_level=-1)
    assert getattr(compiled.find_matches, "__self__", None) is compiled._core

    class Logged(CacheIndex):
        calls = 0

        def find_matches(self, *args: object, **kwargs: object) -> dict:  # type: ignore[override,type-arg]
            Logged.calls += 1
            return super().find_matches(*args, **kwargs)  # type: ignore[arg-type]

    logged = Logged(core="compiled")
    logged.find_matches([1])
    assert Logged.calls == 1  # a subclass's override is kept


def test_answers_from_templates_stay_exact_as_the_index_changes() -> None:
    """48 workers on 3 shared prefixes (one system prompt first) with private tails: the same query shapes come again with
    other runs, and blocks are removed and stored between queries, so templates (earlier answers
    of the same shape) are copied, patched, replaced, and found stale; every answer equals the
    pure core's."""
    rng = random.Random(17)
    system = list(range(1, 9))  # held by all 48: answers of 32+ workers come from templates
    prefixes = [system + list(range(1000 * p, 1000 * p + 32)) for p in range(1, 4)]
    compiled, pure = CacheIndex(core="compiled"), CacheIndex(core="python")

    def apply(b: EventBatch) -> None:
        compiled.apply(b)
        pure.apply(b)

    tails: dict[int, list[int]] = {}
    for w in range(48):
        prefix = prefixes[w % 3][: rng.choice((12, 25, 40))]
        tails[w] = [10**6 * (w + 1) + j for j in range(10)]
        apply(batch([created(0), stored(1, prefix), stored(2, tails[w], parent=prefix[-1])], 0, f"w{w:02}"))
    eid = {w: 3 for w in range(48)}
    seq = {w: 1 for w in range(48)}
    for round_ in range(60):
        w = rng.randrange(48)
        prefix = prefixes[w % 3]
        if round_ % 3 == 1:  # a worker drops the end of its prefix, or stores it again
            cut = rng.randrange(5, 40)
            event = (
                removed(eid[w], prefix[cut:])
                if rng.random() < 0.5
                else stored(eid[w], prefix[cut:], prefix[cut - 1])
            )
            apply(batch([event], seq[w], f"w{w:02}"))
            eid[w] += 1
            seq[w] += 1
        for q in (
            prefix,
            prefix[: rng.randrange(1, 41)],
            [*prefix[:12], *tails[w]],
            prefixes[rng.randrange(3)],
        ):
            assert compiled.find_matches(q) == pure.find_matches(q), (round_, q[:3], len(q))


def test_template_answers_with_long_runs_and_keys_that_are_not_exact_ints() -> None:
    """Runs past CPython's cached small ints (values written into a copied template's entries
    are new int objects) stay exact and alive over repeated queries; query keys that are int
    subclasses are converted like plain ints."""
    import enum
    import gc
    import sys

    prefix = list(range(5000, 5320))
    batches = [batch([created(0), stored(1, prefix[: 260 + (w * 7) % 60])], 0, f"w{w:02}") for w in range(40)]
    compiled, pure = _both(batches)
    expected = pure.find_matches(prefix)
    assert len(set(expected.values())) > 10
    answers = [compiled.find_matches(prefix) for _ in range(5)]  # a template, then copies
    gc.collect()
    assert all(a == expected for a in answers)
    del answers[1:]
    gc.collect()
    assert answers[0] == expected == compiled.find_matches(prefix)  # no value freed early
    assert all(sys.getrefcount(v) >= 2 for v in answers[0].values())

    class Key(enum.IntEnum):
        A = prefix[0]
        B = prefix[1]

    for q in ([Key.A, Key.B, *prefix[2:40]], [True, *prefix[1:40]]):
        assert compiled.find_matches(q) == pure.find_matches(q)


@pytest.mark.parametrize("core", ["compiled", "python"])
@pytest.mark.parametrize("window", [2**31, 2**40, 2**64, -(2**31) - 1])
def test_a_window_size_no_cache_can_have_matches_nothing(core: str, window: int) -> None:
    """The schema's window size is a 32-bit int: a query for a larger one finds no cache (the
    compiled core raised OverflowError converting it; route --serve answered 500). Found by
    fuzzing /match/hashes (make soak)."""
    index = CacheIndex(core=core)
    index.apply(
        EventBatch(
            "i", [KVCacheEvent(0, KVCacheStoredData(None, [KVCacheStoredBlockData(5, [1, 2])]), 64, 0)]
        )
    )
    assert index.find_matches([5]) != {}
    assert index.find_matches([5], window) == {}
    assert index.find_matches_by_content([5], window) == {}
    if core == "compiled":
        assert index._core.match([5], False, window, 3) == []


def test_read_query_keys_reads_every_key_up_to_the_first_that_is_no_hash() -> None:
    """The bench's seam (``read_query_keys``, ``bench/index.py``'s query floor) reads a query
    as find_matches does: lists (past a prefetch group), arrays and other iterables, and stops
    at the first key that is no 64-bit hash."""
    core = CacheIndex(core="compiled")._core
    keys = [(1 << 64) - 1 - k for k in range(70)]
    assert core.read_query_keys(keys) == 70
    assert core.read_query_keys(array("Q", keys)) == 70
    assert core.read_query_keys(tuple(keys)) == 70
    assert core.read_query_keys([*keys[:40], 1 << 64, *keys[:5]]) == 40
    assert core.read_query_keys([*keys[:3], "x"]) == 3
    assert core.read_query_keys([]) == 0
