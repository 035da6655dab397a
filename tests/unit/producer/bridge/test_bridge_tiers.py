"""Property test: the converter's tier handling against a simple model of an engine's media.

The model holds, per block, the set of media the engine reported it on. Applying the converter's
events to a plain dict index (hash -> level) must always give: every block held on some medium
is present at the best level held, and no other block is present.
"""

from __future__ import annotations

from bridge_engines import encode, engine_structs
from hypothesis import given, settings
from hypothesis import strategies as st
from kvevents.producer.bridge import DEFAULT_MEDIUM_LEVELS, ZmqEventConverter
from kvevents.schemas import KVCacheCreatedData, KVCacheRemovedData, KVCacheStoredData, KVCacheUpdatedData

MEDIA = ["GPU", "CPU", "DISK", "EXTERNAL"]
S = engine_structs("vllm")

ops = st.lists(
    st.one_of(
        st.tuples(
            st.just("store"), st.lists(st.integers(0, 7), min_size=1, max_size=4), st.sampled_from(MEDIA)
        ),
        st.tuples(
            st.just("remove"), st.lists(st.integers(0, 7), min_size=1, max_size=4), st.sampled_from(MEDIA)
        ),
        st.tuples(st.just("clear"), st.just([]), st.just("GPU")),
    ),
    max_size=40,
)


def apply(index: dict[int, int], event) -> None:
    data = event.data
    if isinstance(data, KVCacheStoredData):
        for block in data.blocks:
            assert block.block_hash not in index, "stored twice without a remove"
            index[block.block_hash] = block.cache_level
    elif isinstance(data, KVCacheRemovedData):
        for h in data.block_hashes:
            del index[h]
    elif isinstance(data, KVCacheUpdatedData):
        assert data.cache_level is not None and index[data.block_hash] == data.cache_level.old_value
        index[data.block_hash] = data.cache_level.new_value
    elif isinstance(data, KVCacheCreatedData):
        index.clear()


@settings(max_examples=300, deadline=None)
@given(ops)
def test_index_equals_best_tier_of_the_model(operations) -> None:
    conv = ZmqEventConverter("vllm")
    model: dict[int, set[str]] = {}
    index: dict[int, int] = {}
    next_id = 0
    for op, hashes, medium in operations:
        if op == "store":
            hashes = list(dict.fromkeys(hashes))
            event = S["BlockStored"](hashes, None, list(range(len(hashes))), 1, None, medium, None)
            for h in hashes:
                model.setdefault(h, set()).add(medium)
        elif op == "remove":
            known = [h for h in dict.fromkeys(hashes) if h in model]  # engines remove what they hold
            event = S["BlockRemoved"](known, medium)
            for h in known:
                model[h].discard(medium)
                if not model[h]:
                    del model[h]
        else:
            event = S["AllBlocksCleared"]()
            model.clear()
        for e in conv.convert(encode(S["Batch"](0.0, [event]))):
            assert e.event_id == next_id
            next_id += 1
            apply(index, e)
        expected = {h: min(DEFAULT_MEDIUM_LEVELS[m] for m in media) for h, media in model.items()}
        assert index == expected
