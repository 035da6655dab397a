"""ZmqEventConverter against what vLLM 0.34 and SGLang 0.5.23 publish (read from their wheels):
shapes each of which the reader refused whole before, losing every other event of the batch."""

from __future__ import annotations

import hashlib

import pytest
from bridge_engines import encode, engine_structs
from kvevents.consumer import CacheIndex, WorkerKey
from kvevents.producer.bridge import BridgeDecodeError, ZmqEventConverter
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
