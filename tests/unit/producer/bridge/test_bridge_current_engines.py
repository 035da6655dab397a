"""ZmqEventConverter against what vLLM 0.34 and SGLang 0.5.23 publish (read from their wheels):
shapes each of which the reader refused whole before, losing every other event of the batch."""

from __future__ import annotations

import hashlib

import pytest
from bridge_engines import encode, engine_structs
from kvevents.consumer import CacheIndex, WorkerKey
from kvevents.producer.bridge import BridgeDecodeError, ZmqEventConverter
from kvevents.producer.sink_encoded import EncodedEvents
from kvevents.schemas import (
    WIDE_TOKEN_ID,
    EventBatch,
    KVCacheEventDiff,
    KVCacheStoredData,
    KVCacheUpdatedData,
    encode_batch,
)

W = WorkerKey("engine", 0)


def indexed(events: list) -> CacheIndex:
    """The events applied to a fresh index as the Avro bytes the bridge produces."""
    index = CacheIndex()
    index.apply_encoded(encode_batch(EventBatch("engine", events)))
    return index


def test_vllm_offloading_placeholders_are_read_and_the_rest_of_the_batch_kept() -> None:
    """vLLM's OffloadingConnector (``self_describing_kv_events`` off, its default) stores a CPU
    copy as ``BlockStored`` with one hash, no tokens, no parent and ``block_size`` 0."""
    s = engine_structs("vllm-0.34")
    ev = [
        s["BlockStored"]([11, 12], None, list(range(8)), 4, None, "GPU", None, [None, None], 0),
        s["BlockStored"]([12], None, [], 0, None, "CPU", None, None, 0),  # offloaded, still on GPU
        s["BlockStored"]([99], None, [], 0, None, "CPU", None, None, 0),  # only on CPU
        s["BlockRemoved"]([12], "GPU", 0),
    ]
    conv = ZmqEventConverter("vllm")
    events = conv.convert(encode(s["Batch"](1.0, ev, 0)))
    kinds = [type(e.data).__name__ for e in events]
    assert kinds == ["KVCacheStoredData", "KVCacheStoredData", "KVCacheUpdatedData"]
    first, cpu_only, moved = (e.data for e in events)
    assert isinstance(first, KVCacheStoredData) and isinstance(cpu_only, KVCacheStoredData)
    assert [b.block_hash for b in first.blocks] == [11, 12]
    assert [(b.block_hash, list(b.tokens), b.cache_level) for b in cpu_only.blocks] == [(99, [], 1)]
    assert moved == KVCacheUpdatedData(12, cache_level=KVCacheEventDiff(0, 1))
    assert conv.counts["blocks_without_tokens"] == 2
    index = indexed(events)
    assert index.find_matches([11, 12]) == {W: 2} and index.find_matches([99]) == {W: 1}
    contents = {b.block_hash: b.content_hash for b in index.worker_blocks(W, 0)}
    assert contents[99] is None and contents[11] is not None  # a placeholder has no content


def test_block_size_0_with_tokens_is_still_refused_by_name() -> None:
    s = engine_structs("vllm-0.34")
    payload = encode(s["Batch"](1.0, [s["BlockStored"]([5], None, [1, 2], 0, None, "GPU", None)], 0))
    with pytest.raises(BridgeDecodeError, match=r"events\[0\].*block_size 0"):
        ZmqEventConverter("vllm").convert(payload)


def _converters() -> list[ZmqEventConverter]:
    """Every path: the compiled reader (then the typed one), the typed one, the tolerant one."""
    return [
        ZmqEventConverter("vllm", window_size=16),
        ZmqEventConverter("vllm", window_size=16, compiled=False),
        ZmqEventConverter("vllm", window_size=16, compiled=False, fast_path=False),
    ]


def _hybrid_step(s: dict, hashes: list[int], tokens: list[int], kept: list[int], kind: str) -> list:
    """One prefill step of a hybrid vLLM 0.34 model: the attention group stores every block; the
    other group (``kind``) only the blocks at ``kept`` (its null blocks are left out of
    ``block_hashes``, not out of ``token_ids``: ``block_pool.cache_full_blocks``)."""
    stored = s["BlockStored"]
    return [
        stored(hashes, None, tokens, 4, None, "GPU", None, [None] * len(hashes), 0, "full_attention"),
        stored([hashes[i] for i in kept], None, tokens, 4, None, "GPU", None, [None] * len(kept), 1, kind),
    ]


@pytest.mark.parametrize("kind", ["mamba", "chunked_local_attention"])
def test_vllm_hybrid_model_groups_that_mirror_attention_are_skipped_not_fatal(kind: str) -> None:
    """A hybrid model (Mamba layers in align mode, Llama 4's local-attention chunks) publishes
    a second group with the same hashes for some of the blocks, its stores with fewer hashes
    than pages. The batch used to be refused whole (the attention blocks lost with it, the
    worker degraded), and that group's evictions removed blocks attention still held."""
    s = engine_structs("vllm-0.34")
    hashes, tokens = [161, 162, 163, 164], list(range(16))
    step1 = encode(s["Batch"](1.0, _hybrid_step(s, hashes, tokens, [3], kind), 0))
    later = [
        s["BlockRemoved"]([164], "GPU", 1),
        s["BlockRemoved"]([161], "GPU", 1),
        s["BlockStored"]([165], 164, list(range(16, 20)), 4, None, "GPU", None, None, 1),  # no kind named
    ]
    evict = encode(s["Batch"](2.0, later, 0))
    results = []
    for conv in _converters():
        events = conv.convert(step1) + conv.convert(evict)
        index = indexed(events)
        assert index.find_matches(hashes) == {W: 4}, conv.stats()
        assert index.find_matches_for_tokens(tokens, 4) == {W: 4}
        assert conv.counts["skipped_group_events"] == 4 and conv.group_windows == {0: 16, 1: -1}
        assert index.find_matches([*hashes, 165]) == {W: 4}
        results.append((events, conv.stats(), conv.to_state()))
    assert results[0] == results[1] == results[2]
    pre_encoded = ZmqEventConverter("vllm", window_size=16)
    out = EncodedEvents()
    assert pre_encoded.convert_encoded(step1, out) and pre_encoded.convert_encoded(evict, out)
    assert out.decode() == results[0][0] and pre_encoded.stats() == results[0][1]


@pytest.mark.parametrize(
    ("kind", "window"),
    [("unknown", None), ("sliding_window", None), ("sliding_window_mla", None), ("a_newer_kind", None)],
)
def test_vllm_groups_of_unknown_meaning_are_skipped_not_taken_as_attention(
    kind: str, window: int | None
) -> None:
    """vLLM 0.34 names kind ``unknown`` for a group of mixed layer types, and no window for a
    sliding-window group whose layers differ: taken in the default window, that group's
    evictions removed blocks the attention group still held. Now the group is skipped and
    counted, on every path, as Dynamo's router drops it."""
    s = engine_structs("vllm-0.34")
    stored = s["BlockStored"]
    hashes, tokens = [171, 172], list(range(8))
    step = [
        stored(hashes, None, tokens, 4, None, "GPU", None, None, 0, "full_attention"),
        stored(hashes, None, tokens, 4, None, "GPU", None, None, 1, kind, window),
    ]
    evict = [s["BlockRemoved"]([172], "GPU", 1), s["BlockRemoved"]([171], "GPU", 1)]
    results = []
    for conv in _converters():
        events = conv.convert(encode(s["Batch"](1.0, step, 0))) + conv.convert(
            encode(s["Batch"](2.0, evict, 0))
        )
        assert indexed(events).find_matches(hashes) == {W: 2}, conv.stats()
        assert conv.counts["skipped_group_events"] == 3 and conv.group_windows == {0: 16, 1: -1}
        results.append((events, conv.stats(), conv.to_state()))
    assert results[0] == results[1] == results[2]


def test_evictions_of_a_group_never_described_are_skipped_unless_it_is_group_0() -> None:
    """A removal naming a group no Stored event described yet (a bridge started without its
    state, mid-stream): group 0 takes the default window; another group may be a sliding
    window's, whose evictions are not the block's, so it is skipped and counted."""
    s = engine_structs("vllm-0.34")
    stored = s["BlockStored"]
    first = [stored([181, 182], None, list(range(8)), 4, None, "GPU", None, None)]  # no group named
    later = [s["BlockRemoved"]([182], "GPU", 2), s["BlockRemoved"]([181], "GPU", 0)]
    results = []
    for conv in _converters():
        events = conv.convert(encode(s["Batch"](1.0, first, 0))) + conv.convert(
            encode(s["Batch"](2.0, later, 0))
        )
        index = indexed(events)
        assert index.find_matches([181, 182]) == {} and index.find_matches([182]) == {W: 1}, conv.stats()
        assert conv.counts["unknown_group"] == 2 and conv.counts["skipped_group_events"] == 1
        results.append((events, conv.stats(), conv.to_state()))
    assert results[0] == results[1] == results[2]


def test_vllm_sliding_window_group_with_masked_blocks_carries_its_hashes_without_tokens() -> None:
    """A sliding-window group whose unreachable blocks vLLM masks (``reachable_block_mask``)
    names fewer hashes than its pages of tokens: which page each names is unknown, so its
    blocks are carried by engine hash only, in the group's own window; an event naming no
    hash (every page masked) stores nothing. The attention group's blocks are untouched."""
    s = engine_structs("vllm-0.34")
    stored = s["BlockStored"]
    hashes, tokens = [161, 162, 163, 164], list(range(16))
    ev = [
        stored(hashes, None, tokens, 4, None, "GPU", None, None, 0, "full_attention"),
        stored([162, 164], None, tokens, 4, None, "GPU", None, None, 1, "sliding_window", 8),
        stored([], 164, list(range(16, 24)), 4, None, "GPU", None, None, 1, "sliding_window", 8),
    ]
    payload = encode(s["Batch"](1.0, ev, 0))
    results = []
    for conv in _converters():
        events = conv.convert(payload)
        windows = [(e.window_size, [(b.block_hash, len(b.tokens)) for b in e.data.blocks]) for e in events]
        assert windows == [(16, [(h, 4) for h in hashes]), (8, [(162, 0), (164, 0)])]
        assert conv.counts["sparse_group_events"] == 1 and conv.counts["stored_pages_without_hashes"] == 1
        index = indexed(events)
        assert index.find_matches_for_tokens(tokens, 4) == {W: 4}
        assert index.find_matches([164], window_size=8) == {W: 1}
        results.append((events, conv.stats()))
    assert results[0] == results[1] == results[2]


@pytest.mark.parametrize(
    ("hashes", "tokens", "group"),
    [([5], list(range(7)), 0), ([5], list(range(8)), None), ([], [1, 2], None)],
)
def test_tokens_that_do_not_fit_the_hashes_are_still_refused_outside_that_shape(
    hashes: list[int], tokens: list[int], group: int | None
) -> None:
    """Only whole pages beyond the hashes of a grouped event are vLLM's skipped blocks; other
    mismatches stay errors that name the event."""
    s = engine_structs("vllm-0.34")
    ev = s["BlockStored"](
        hashes, None, tokens, 4, None, "GPU", None, None, group, None if group is None else "full_attention"
    )
    for conv in _converters():
        with pytest.raises(BridgeDecodeError, match=r"events\[0\]"):
            conv.convert(encode(s["Batch"](1.0, [ev], 0)))


def test_vllm_lookahead_token_ids_are_counted_and_the_blocks_read() -> None:
    s = engine_structs("vllm-0.34")
    ev = [s["BlockStored"]([7], None, [1, 2], 2, None, "GPU", None, lookahead_token_ids=[[3]])]
    conv = ZmqEventConverter("vllm")
    events = conv.convert(encode(s["Batch"](1.0, ev, 0)))
    assert [b.block_hash for b in events[0].data.blocks] == [7]
    assert conv.wire_counts.unknown_fields["BlockStored.lookahead_token_ids"] == 1


def _pad_values(image: bytes) -> list[int]:
    """Four pad tokens of an image as SGLang 0.5.23 derives them: 10**6 plus 62 bits of a digest."""
    digest = hashlib.sha256(b"pad" + image).digest()
    return [10**6 + (int.from_bytes(digest[i : i + 8], "big") & (2**62 - 1)) for i in range(0, 32, 8)]


def test_sglang_multimodal_pad_tokens_are_carried_as_wide_tokens() -> None:
    s = engine_structs("sglang-0.5.23")
    cat, dog = _pad_values(b"cat"), _pad_values(b"dog")
    ev = [
        s["BlockStored"]([-5], None, [1, 2, *cat[:2]], 4, None, "GPU"),
        s["BlockStored"]([-6], None, [1, 2, *dog[:2]], 4, None, "GPU"),
        s["BlockStored"]([-7], None, [1, 2, 3, 4], 4, None, "GPU"),  # text: as before
    ]
    conv = ZmqEventConverter("sglang")
    events = conv.convert(encode(s["Batch"](1.0, ev, 0)))
    blocks = [e.data.blocks[0] for e in events]
    assert list(blocks[0].tokens) == [1, 2, WIDE_TOKEN_ID, WIDE_TOKEN_ID]
    assert list(blocks[0].token_extra_ids) == [0, 0, *cat[:2]]
    assert blocks[2].token_extra_ids is None
    assert conv.counts["wide_tokens"] == 4
    index = indexed(events)
    contents = {b.block_hash: b.content_hash for b in index.worker_blocks(W, 0)}
    assert len(set(contents.values())) == 3  # two images' blocks never share a content hash
    found = index.find_matches_for_tokens(
        [1, 2, WIDE_TOKEN_ID, WIDE_TOKEN_ID], 4, token_extra_ids=[0, 0, *dog[:2]]
    )
    assert found == {W: 1}


def test_sglang_eagle_bigram_pairs_give_the_blocks_own_tokens() -> None:
    """With EAGLE, SGLang's radix keys are (token, next token) pairs, published as such."""
    s = engine_structs("sglang-0.5.23")
    raw = [5, 6, 7, 8, 9, 10, 11, 12, 13]
    pairs = [[raw[j], raw[j + 1]] for j in range(8)]
    ev = [
        s["BlockStored"]([21], None, pairs[:4], 4, None, "GPU"),
        s["BlockStored"]([22], 21, pairs[4:], 4, None, "GPU"),
    ]
    conv = ZmqEventConverter("sglang")
    events = conv.convert(encode(s["Batch"](1.0, ev, 0)))
    assert [list(e.data.blocks[0].tokens) for e in events] == [raw[:4], raw[4:8]]
    assert conv.counts["token_pair_blocks"] == 2
    assert indexed(events).find_matches_for_tokens(raw[:8], 4) == {W: 2}


@pytest.mark.parametrize(
    ("token_ids", "needle"),
    [
        ([1, [2, 3, 4]], r"token_ids\[1\].*not a token id"),
        ([1, "x"], r"token_ids\[1\].*not a token id"),
        ([1, [2, None]], r"token_ids\[1\].*not a token id"),
        ([[1, 2.5]], r"token_ids\[0\].*not a token id"),
    ],
)
def test_token_ids_that_are_neither_ints_nor_pairs_are_refused_by_name(token_ids: list, needle: str) -> None:
    s = engine_structs("sglang-0.5.23")
    payload = encode(s["Batch"](1.0, [s["BlockStored"]([1], None, token_ids, 2, None, "GPU")], 0))
    with pytest.raises(BridgeDecodeError, match=needle):
        ZmqEventConverter("sglang").convert(payload)


def test_an_empty_medium_is_the_default_one_not_a_new_tier() -> None:
    """A medium named but empty is the default (GPU, level 0), as no medium is, on every path:
    it used to become a new, slower tier (``new_medium.``), and the compiled reader declined it."""
    s = engine_structs("vllm-0.34")
    stored = s["BlockStored"]
    named = [stored([191, 192], None, list(range(8)), 4, None, "", None, None), s["BlockRemoved"]([192], "")]
    plain = [
        stored([191, 192], None, list(range(8)), 4, None, None, None, None),
        s["BlockRemoved"]([192], None),
    ]
    expected = ZmqEventConverter("vllm", window_size=16).convert(encode(s["Batch"](1.0, plain, 0)))
    for conv in _converters():
        assert conv.convert(encode(s["Batch"](1.0, named, 0))) == expected
        assert not [k for k in conv.stats() if k.startswith("new_medium")]
    compiled = ZmqEventConverter("vllm", window_size=16)
    compiled.convert(encode(s["Batch"](1.0, named, 0)))
    assert compiled.compiled_payloads == 1
