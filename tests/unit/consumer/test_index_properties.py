"""Property tests: random troubled streams through both cores and both entry points agree with
the naive reference model, and the state survives to_bytes/from_bytes."""

from __future__ import annotations

import itertools

import pytest
from _index_model import NaiveIndex, TroubledProducer
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kvevents.consumer import CacheIndex, WorkerKey
from kvevents.consumer.index import compiled_core_available
from kvevents.schemas import KVCacheStoredData, encode_batch

if not compiled_core_available():  # pragma: no cover - a build problem must fail, not skip
    pytest.fail("kvevents.consumer._indexcore is not built", pytrace=False)


def stream(data: st.DataObject) -> list:
    producer = TroubledProducer(data.draw, st)
    for _ in range(data.draw(st.integers(5, 70), label="steps")):
        producer.step()
    for name, inst in producer.instances.items():
        producer.flush(inst, name)
    return producer.delivered


def engine_queries(batches: list, data: st.DataObject) -> list[list[int]]:
    chains = [
        [b.block_hash for b in e.data.blocks]
        for batch in batches
        for e in batch.events
        if isinstance(e.data, KVCacheStoredData)
    ]
    queries = [c[:k] for c in chains for k in range(1, len(c) + 1)]
    queries += [a + b for a, b in itertools.pairwise(chains)]
    queries.append(data.draw(st.lists(st.integers(0, 2**64 - 1), max_size=3)))
    return queries


def token_queries() -> list[list[int]]:
    blocks = [list(p) for p in itertools.product(range(3), repeat=2)]
    queries = [b for b in blocks]
    queries += [a + b for a in blocks for b in blocks]
    queries += [a + b + c for a in blocks[:4] for b in blocks[:4] for c in blocks[:4]]
    return queries


@settings(
    max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large]
)
@given(st.data())
def test_cores_and_entry_points_agree_with_the_naive_model(data: st.DataObject) -> None:
    batches = stream(data)
    model = NaiveIndex()
    py_obj = CacheIndex(core="python")
    c_obj = CacheIndex(core="compiled")
    c_bytes = CacheIndex(core="compiled")
    py_bytes = CacheIndex(core="python")
    indexes = (py_obj, c_obj, c_bytes, py_bytes)
    for batch in batches:
        model.apply(batch)
        py_obj.apply(batch)
        c_obj.apply(batch)
        encoded = encode_batch(batch)
        c_bytes.apply_encoded(encoded)
        py_bytes.apply_encoded(encoded)
        expected = sorted(WorkerKey(*k) for k, w in model.workers.items() if w.gaps)
        for index in indexes:
            assert index.degraded_workers() == expected

    keys = sorted(WorkerKey(*k) for k in model.workers)
    for index in indexes:
        assert index.workers() == keys
        for key in keys:
            mw = model.workers[key]
            stats = index.worker_stats(key)
            assert stats.last_event_id == mw.cursor
            assert sorted(stats.windows) == sorted(mw.windows)
            for window, win in mw.windows.items():
                assert stats.windows[window].capacity == win["capacity"]
                assert [tuple(b) for b in index.worker_blocks(key, window)] == model.blocks(key, window)
        assert index.held_blocks() == sum(
            len(win["blocks"]) for w in model.workers.values() for win in w.windows.values()
        )

    for query, by_content in [(q, False) for q in engine_queries(batches, data)] + [
        (py_obj.content_hashes(t, 2), True) for t in token_queries()
    ]:
        for window, max_level in [(None, 15), (None, 0), (64, 15), (128, 0)]:
            want = {WorkerKey(*k): v for k, v in model.match(query, by_content, window, max_level).items()}
            for index in indexes:
                details = index.match_details(
                    query, by_content=by_content, window_size=window, max_cache_level=max_level
                )
                assert {k: (m.blocks, m.primary_blocks) for k, m in details.items()} == want
                finder = index.find_matches_by_content if by_content else index.find_matches
                assert finder(query, window, max_cache_level=max_level) == {k: v[0] for k, v in want.items()}

    state = py_obj.to_bytes()
    for index in indexes:
        assert index.to_bytes() == state
    assert c_obj.stats().counters == py_obj.stats().counters == c_bytes.stats().counters
    for core in ("python", "compiled"):
        restored = CacheIndex.from_bytes(state, core=core)
        assert restored.to_bytes() == state
        assert restored.find_matches(
            engine_queries(batches, data)[0] if batches else []
        ) == c_obj.find_matches(engine_queries(batches, data)[0] if batches else [])


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large]
)
@given(st.data())
def test_restored_index_continues_like_the_original(data: st.DataObject) -> None:
    """A restored index applied the rest of the stream equals one that applied it all."""
    batches = stream(data)
    cut = data.draw(st.integers(0, len(batches)), label="cut")
    whole = CacheIndex(core="compiled")
    for batch in batches:
        whole.apply(batch)
    for core_before, core_after in [("compiled", "python"), ("python", "compiled")]:
        first = CacheIndex(core=core_before)
        for batch in batches[:cut]:
            first.apply(batch)
        resumed = CacheIndex.from_bytes(first.to_bytes(), core=core_after)
        for batch in batches[cut:]:
            resumed.apply_encoded(encode_batch(batch))
        assert resumed.to_bytes() == whole.to_bytes()
