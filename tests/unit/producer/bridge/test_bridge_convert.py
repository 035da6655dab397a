"""ZmqEventConverter against payloads encoded exactly as vLLM and SGLang encode them."""

from __future__ import annotations

import hashlib
from typing import Any

import msgspec
import pytest
from bridge_engines import encode, engine_structs
from kvevents.producer.bridge import BridgeDecodeError, ZmqEventConverter, lora_id_for_name
from kvevents.producer.mm_keys import mm_key_from_text
from kvevents.schemas import (
    DecodeError,
    KVCacheCreatedData,
    KVCacheEventDiff,
    KVCacheRemovedData,
    KVCacheStoredData,
    KVCacheUpdatedData,
)

U64 = (1 << 64) - 1


def stored_of(events):
    return [e for e in events if isinstance(e.data, KVCacheStoredData)]


@pytest.mark.parametrize("kind", ["vllm", "vllm-positional"])
def test_vllm_stored_and_removed_every_encoding(kind: str) -> None:
    s = engine_structs(kind)
    ev = [
        s["BlockStored"]([11, 12], None, list(range(8)), 4, None, "GPU", None),
        s["BlockRemoved"]([11], "GPU"),
    ]
    payload = encode(s["Batch"](1.5, ev, 3))
    conv = ZmqEventConverter("vllm", window_size=128)
    events = conv.convert(payload)
    assert [e.event_id for e in events] == [0, 1]
    assert all(e.attention_dp_rank == 3 and e.window_size == 128 for e in events)
    stored = events[0].data
    assert isinstance(stored, KVCacheStoredData) and stored.parent_hash is None
    assert [b.block_hash for b in stored.blocks] == [11, 12]
    assert [list(b.tokens) for b in stored.blocks] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert all(b.cache_level == 0 and b.lora_id is None for b in stored.blocks)
    assert events[1].data == KVCacheRemovedData([11])
    # ids continue across calls
    assert conv.convert(encode(s["Batch"](2.0, [s["BlockRemoved"]([12], "GPU")], 3)))[0].event_id == 2


def test_batch_shapes_two_three_and_map() -> None:
    s = engine_structs("vllm-positional")
    event = s["BlockStored"]([5], None, [1, 2], 2, None, "GPU", None)
    two = msgspec.msgpack.encode([1.0, [event]])
    three = encode(s["Batch"](1.0, [event], 2))
    as_map = msgspec.msgpack.encode({"ts": 1.0, "events": [event], "data_parallel_rank": 4})
    assert ZmqEventConverter("vllm", dp_rank=7).convert(two)[0].attention_dp_rank == 7
    assert ZmqEventConverter("vllm").convert(three)[0].attention_dp_rank == 2
    assert ZmqEventConverter("vllm").convert(as_map)[0].attention_dp_rank == 4
    none_rank = msgspec.msgpack.encode([1.0, [event], None])
    assert ZmqEventConverter("vllm", dp_rank=1).convert(none_rank)[0].attention_dp_rank == 1


def test_trailing_fields_missing_in_arrays() -> None:
    # vLLM 0.8: BlockStored had 5 fields, BlockRemoved 1, batch [ts, events]
    payload = msgspec.msgpack.encode(
        [0.0, [["BlockStored", [1, 2], 9, [1, 2, 3, 4], 2, 7], ["BlockRemoved", [1]]]]
    )
    events = ZmqEventConverter("vllm").convert(payload)
    assert events[0].data.parent_hash == 9 and events[0].data.blocks[0].lora_id == 7
    assert events[1].data == KVCacheRemovedData([1])


def test_digests_fold_like_vllm_int_mode_and_signed_ints() -> None:
    s = engine_structs("vllm")
    d1, d2 = hashlib.sha256(b"a").digest(), hashlib.sha256(b"b").digest()
    payload = encode(s["Batch"](0.0, [s["BlockStored"]([d2], d1, [1], 1, None, "GPU", None)]))
    event = ZmqEventConverter("vllm").convert(payload)[0]
    assert event.data.parent_hash == int.from_bytes(d1[-8:], "big")
    assert event.data.blocks[0].block_hash == int.from_bytes(d2[-8:], "big")
    # SGLang: signed int64 = first 8 bytes; negative ints fold two's complement
    g = engine_structs("sglang")
    neg = int.from_bytes(d1[:8], "big", signed=True)
    ev = ZmqEventConverter("sglang").convert(
        encode(g["Batch"](0.0, [g["BlockStored"]([-1, neg], None, [1, 2], 1, None, "GPU")]))
    )
    assert [b.block_hash for b in ev[0].data.blocks] == [U64, neg & U64]
    # a digest from SGLang folds to its first 8 bytes
    raw = msgspec.msgpack.encode([0.0, [["BlockStored", [d1], None, [1], 1, None, "GPU"]]])
    assert ZmqEventConverter("sglang").convert(raw)[0].data.blocks[0].block_hash == int.from_bytes(
        d1[:8], "big"
    )


def test_sglang_old_and_partial_final_page() -> None:
    s = engine_structs("sglang-old")
    payload = encode(s["Batch"](0.0, [s["BlockStored"]([1, 2, 3], None, list(range(10)), 4, None)]))
    conv = ZmqEventConverter("sglang")
    blocks = conv.convert(payload)[0].data.blocks
    assert [len(b.tokens) for b in blocks] == [4, 4, 2]
    assert conv.stats()["partial_blocks"] == 1
    # SGLang's own partial page: a one-block event whose block_size is its token count
    page = encode(s["Batch"](0.0, [s["BlockStored"]([4], 3, [10, 11, 12], 3, None)]))
    assert list(conv.convert(page)[0].data.blocks[0].tokens) == [10, 11, 12]


def test_sglang_metadata_map_at_position_seven_and_map_events() -> None:
    s = engine_structs("sglang")
    payload = encode(
        s["Batch"](
            0.0, [s["BlockStored"]([1], None, [1, 2], 2, None, "CPU_PINNED", {"cache_salt": "salty"})], 2
        )
    )
    event = ZmqEventConverter("sglang").convert(payload)[0]
    block = event.data.blocks[0]
    assert block.cache_salt == "salty" and block.cache_level == 1 and event.attention_dp_rank == 2
    m = engine_structs("sglang-map")
    payload = encode(m["Batch"](0.0, [m["BlockStored"]([1], None, [1], 1, None, "GPU", "s2", "sess")], 0))
    assert ZmqEventConverter("sglang").convert(payload)[0].data.blocks[0].cache_salt == "s2"
    meta = msgspec.msgpack.encode(
        {
            "ts": 0,
            "events": [
                {
                    "type": "BlockStored",
                    "block_hashes": [1],
                    "parent_block_hash": None,
                    "token_ids": [1],
                    "block_size": 1,
                    "lora_id": None,
                    "medium": "GPU",
                    "metadata": {"cache_salt": "s3", "mystery": 1},
                }
            ],
        }
    )
    conv = ZmqEventConverter("sglang")
    assert conv.convert(meta)[0].data.blocks[0].cache_salt == "s3"
    assert conv.stats()["unknown_fields"] == {"BlockStored.metadata.mystery": 1}


def test_media_levels_including_sglang_tiers() -> None:
    s = engine_structs("sglang")
    conv = ZmqEventConverter("sglang")
    levels = {}
    for k, medium in enumerate(["GPU", "CPU_PINNED", "DISK", "EXTERNAL", "CPU", "NVME_OF"]):
        ev = conv.convert(encode(s["Batch"](0.0, [s["BlockStored"]([100 + k], None, [k], 1, None, medium)])))
        levels[medium] = ev[0].data.blocks[0].cache_level
    assert levels["GPU"] == 0 and levels["CPU_PINNED"] == levels["CPU"] == 1
    assert levels["DISK"] == 2 and levels["EXTERNAL"] == 3 and levels["NVME_OF"] == 4
    none_medium = encode(s["Batch"](0.0, [s["BlockStored"]([999], None, [1], 1, None, None)]))
    assert conv.convert(none_medium)[0].data.blocks[0].cache_level == 0


def test_gpu_and_cpu_copy_is_one_entry_whose_level_moves() -> None:
    s = engine_structs("vllm")
    conv = ZmqEventConverter("vllm")

    def send(*events):
        return conv.convert(encode(s["Batch"](0.0, list(events))))

    assert isinstance(
        send(s["BlockStored"]([1, 2], None, [1, 2], 1, None, "GPU", None))[0].data, KVCacheStoredData
    )
    assert send(s["BlockStored"]([1, 2], None, [1, 2], 1, None, "CPU", None)) == []  # GPU copy stays best
    moved = send(s["BlockRemoved"]([1, 2], "GPU"))  # offloaded: level moves 0 -> 1, nothing deleted
    assert [e.data for e in moved] == [
        KVCacheUpdatedData(1, cache_level=KVCacheEventDiff(0, 1)),
        KVCacheUpdatedData(2, cache_level=KVCacheEventDiff(0, 1)),
    ]
    back = send(s["BlockStored"]([1], None, [1], 1, None, "GPU", None))  # reloaded to GPU
    assert back[0].data == KVCacheUpdatedData(1, cache_level=KVCacheEventDiff(1, 0))
    gone = send(s["BlockRemoved"]([2], "CPU"))
    assert gone[0].data == KVCacheRemovedData([2])
    # a remove on a medium that does not hold it changes nothing
    assert send(s["BlockRemoved"]([1], "DISK")) == []
    assert conv.stats()["removed_not_on_medium"] == 1


def test_stored_with_some_blocks_already_held_keeps_parent_chain() -> None:
    s = engine_structs("vllm")
    conv = ZmqEventConverter("vllm")
    conv.convert(encode(s["Batch"](0.0, [s["BlockStored"]([2], 1, [2], 1, None, "GPU", None)])))
    events = conv.convert(
        encode(s["Batch"](0.0, [s["BlockStored"]([1, 2, 3], None, [1, 2, 3], 1, None, "GPU", None)]))
    )
    assert [(e.data.parent_hash, [b.block_hash for b in e.data.blocks]) for e in events] == [
        (None, [1]),
        (2, [3]),
    ]


def test_all_blocks_cleared_is_created_and_empties_tiers() -> None:
    for kind in ("vllm", "vllm-positional", "sglang-old"):
        s = engine_structs(kind)
        conv = ZmqEventConverter("vllm" if kind.startswith("vllm") else "sglang")
        stored = s["BlockStored"](
            [1], None, [1], 1, None, *(["GPU", None] if kind.startswith("vllm") else [])
        )
        conv.convert(encode(s["Batch"](0.0, [stored])))
        events = conv.convert(encode(s["Batch"](0.0, [s["AllBlocksCleared"]()])))
        assert isinstance(events[0].data, KVCacheCreatedData) and events[0].event_id == 1
        assert conv.stats()["blocks_held"] == 0


def test_lora_id_or_stable_id_from_name_and_mm_extra_keys() -> None:
    s = engine_structs("vllm")
    mm = hashlib.sha256(b"image").hexdigest()
    mm2 = hashlib.sha256(b"image2").digest()
    stored = s["BlockStored"](
        [1, 2],
        None,
        [1, 2, 3, 4],
        2,
        None,
        "GPU",
        "my-adapter",
        [("my-adapter", mm, "salt-1"), ("my-adapter", [mm2.hex(), 1])],
    )
    blocks = ZmqEventConverter("vllm").convert(encode(s["Batch"](0.0, [stored])))[0].data.blocks
    assert blocks[0].lora_id == lora_id_for_name("my-adapter") == blocks[1].lora_id
    assert lora_id_for_name("my-adapter") == lora_id_for_name("my-adapter") != lora_id_for_name("other")
    assert blocks[0].mm_keys == ((bytes.fromhex(mm), 0),) and blocks[0].cache_salt == "salt-1"
    assert blocks[1].mm_keys == ((mm2, 1),) and blocks[1].cache_salt is None
    with_id = s["BlockStored"]([3], None, [1], 1, 42, "GPU", "x")
    assert (
        ZmqEventConverter("vllm").convert(encode(s["Batch"](0.0, [with_id])))[0].data.blocks[0].lora_id == 42
    )


def test_sliding_window_groups_map_to_window_size() -> None:
    s = engine_structs("vllm")
    conv = ZmqEventConverter("vllm", window_size=0)
    full = s["BlockStored"]([1], None, [1], 1, None, "GPU", None, None, 0, "full_attention", None)
    swa = s["BlockStored"]([1], None, [1], 1, None, "GPU", None, None, 1, "sliding_window", 512)
    events = conv.convert(encode(s["Batch"](0.0, [full, swa, s["BlockRemoved"]([1], "GPU", 1)])))
    assert [e.window_size for e in events] == [0, 512, 512]
    assert events[2].data == KVCacheRemovedData([1])  # same hash, other group: a separate entry
    assert conv.stats()["blocks_held"] == 1


def test_unknown_tags_and_fields_counted_and_skipped() -> None:
    payload = msgspec.msgpack.encode(
        {
            "ts": 1.0,
            "events": [
                {"type": "BlockPinned", "block_hashes": [1]},
                ["FutureEvent", 1, 2],
                {
                    "type": "BlockStored",
                    "block_hashes": [1],
                    "parent_block_hash": None,
                    "token_ids": [1],
                    "block_size": 1,
                    "lora_id": None,
                    "medium": "GPU",
                    "new_field": [1, 2],
                },
                ["BlockRemoved", [1], "GPU", None, "extra"],
            ],
            "new_batch_field": 1,
        }
    )
    conv = ZmqEventConverter("vllm")
    events = conv.convert(payload)
    assert [type(e.data) for e in events] == [KVCacheStoredData, KVCacheRemovedData]
    stats = conv.stats()
    assert stats["unknown_tags"] == {"BlockPinned": 1, "FutureEvent": 1}
    assert stats["unknown_fields"] == {
        "BlockStored.new_field": 1,
        "BlockRemoved[4+]": 1,
        "batch.new_batch_field": 1,
    }


@pytest.mark.parametrize(
    ("payload", "needle"),
    [
        (b"\xc1", "not msgpack"),
        (b"", "not msgpack"),
        (msgspec.msgpack.encode(5), "array or a map"),
        (msgspec.msgpack.encode([1.0]), "expected [ts, events"),
        (msgspec.msgpack.encode([1.0, 5]), "events must be an array"),
        (msgspec.msgpack.encode({"ts": 1.0}), "no 'events'"),
        (msgspec.msgpack.encode([1.0, [7]]), "events[0]"),
        (msgspec.msgpack.encode([1.0, [[]]]), "tag"),
        (msgspec.msgpack.encode([1.0, [{"block_hashes": [1]}]]), "'type'"),
        (msgspec.msgpack.encode([1.0, [["BlockStored", "x", None, [], 1]]]), "block_hashes"),
        (msgspec.msgpack.encode([1.0, [["BlockStored", [1.5], None, [1], 1]]]), "block_hashes[0]"),
        (msgspec.msgpack.encode([1.0, [["BlockStored", [1], None, [1, 2, 3], 1]]]), "do not fill"),
        (msgspec.msgpack.encode([1.0, [["BlockStored", [1], None, [1], 0]]]), "block_size"),
        (msgspec.msgpack.encode([1.0, [["BlockStored", [1], None, [1.5], 1]]]), "token_ids[0]"),
        (msgspec.msgpack.encode([1.0, [["BlockStored", [1], None, [1], 1, None, 5]]]), "medium"),
        (msgspec.msgpack.encode([1.0, [["BlockRemoved", [True]]]]), "bool"),
        (msgspec.msgpack.encode(["x", []]), "ts"),
        (msgspec.msgpack.encode([1.0, [], -1]), "dp rank"),
    ],
)
def test_malformed_payloads_raise_a_clear_error_and_keep_state(payload: bytes, needle: str) -> None:
    conv = ZmqEventConverter("vllm")
    good = msgspec.msgpack.encode([1.0, [["BlockStored", [1], None, [1], 1, None, "GPU"]]])
    conv.convert(good)
    before = conv.to_state()
    with pytest.raises(BridgeDecodeError) as info:
        conv.convert(payload)
    assert needle in str(info.value) and isinstance(info.value, DecodeError)
    assert conv.to_state() == before
    assert conv.convert(good) == []  # still working (block already held)


def test_bad_second_event_leaves_first_unapplied() -> None:
    conv = ZmqEventConverter("vllm")
    payload = msgspec.msgpack.encode(
        [1.0, [["BlockStored", [1], None, [1], 1], ["BlockStored", [2], None, [1, 2], 1]]]
    )
    with pytest.raises(BridgeDecodeError, match=r"events\[1\]"):
        conv.convert(payload)
    assert conv.to_state()["next_event_id"] == {} and conv.stats()["blocks_held"] == 0


def test_state_round_trip() -> None:
    s = engine_structs("vllm")
    conv = ZmqEventConverter("vllm", window_size=64, dp_rank=1)
    conv.convert(encode(s["Batch"](0.0, [s["BlockStored"]([1, 2], None, [1, 2], 1, None, "FLASH", None)])))
    again = ZmqEventConverter.from_state(msgspec.json.decode(msgspec.json.encode(conv.to_state())))
    nxt = encode(s["Batch"](0.0, [s["BlockRemoved"]([1], "FLASH")]))
    assert again.convert(nxt) == conv.convert(nxt)


def test_constructor_checks() -> None:
    with pytest.raises(ValueError, match="engine"):
        ZmqEventConverter("trtllm")
    with pytest.raises(ValueError, match="window_size"):
        ZmqEventConverter("vllm", window_size=-1)


def test_mm_offsets_are_kept_as_sent_negative_included_and_out_of_range_ones_counted() -> None:
    s = engine_structs("vllm")
    mm = hashlib.sha256(b"image").digest()
    stored = s["BlockStored"](
        [1, 2, 3],
        None,
        [1, 2, 3, 4, 5, 6],
        2,
        None,
        "GPU",
        None,
        [[[mm.hex(), 0]], [[mm.hex(), -2]], [[mm.hex(), 2**31]]],
    )
    conv = ZmqEventConverter("vllm")
    blocks = conv.convert(encode(s["Batch"](0.0, [stored])))[0].data.blocks
    # An item that began two tokens before the second block: a different block than offset 0.
    assert [b.mm_keys for b in blocks] == [((mm, 0),), ((mm, -2),), ()]
    assert conv.stats()["extra_keys_skipped"] == 1


def test_typed_extra_keys_are_read_like_the_raw_ones() -> None:
    """vLLM's typed extra keys (maps tagged ``mm``, ``cache_salt``, ``lora``, ``prompt_embeds``,
    ``legacy``) give the same mm keys and salt as the raw tuples; prompt embeddings are counted."""
    s = engine_structs("vllm")
    mm = hashlib.sha256(b"image").digest()
    typed = [
        [
            {"type": "mm", "modality": "image", "hash": mm.hex(), "block_offset": 0},
            {"type": "cache_salt", "salt": "tenant"},
        ],
        [{"type": "lora", "name": "adapter"}, {"type": "prompt_embeds", "hash": b"\x01" * 32}],
        [{"type": "legacy", "value": [mm.hex(), -1]}, {"type": "mystery"}],
    ]
    stored = s["BlockStored"]([1, 2, 3], None, [1, 2, 3, 4, 5, 6], 2, None, "GPU", "adapter", typed)
    conv = ZmqEventConverter("vllm")
    blocks = conv.convert(encode(s["Batch"](0.0, [stored])))[0].data.blocks
    assert [(b.mm_keys, b.cache_salt) for b in blocks] == [
        (((mm, 0),), "tenant"),
        ((), None),
        (((mm, -1),), None),
    ]
    assert conv.stats()["extra_keys_skipped"] == 2  # the prompt embeddings and the unknown key
    raw = [[[mm.hex(), 0], "tenant"], ["adapter"], [[mm.hex(), -1]]]
    again = ZmqEventConverter("vllm").convert(
        encode(
            s["Batch"](
                0.0, [s["BlockStored"]([1, 2, 3], None, [1, 2, 3, 4, 5, 6], 2, None, "GPU", "adapter", raw)]
            )
        )
    )
    assert again[0].data.blocks == blocks


@pytest.mark.parametrize("identifier", ["sku-1234", "adapter:" + "ab" * 32, "\u6d4b\u8bd5"])
def test_an_mm_identifier_that_is_not_a_digest_is_an_mm_key_not_a_salt(identifier: str) -> None:
    """An ``(identifier, offset)`` pair always names a multimodal item: a user-given UUID or an
    identifier with a LoRA prefix was taken for the block's cache salt."""
    s = engine_structs("vllm")
    stored = s["BlockStored"]([1], None, [1, 2], 2, None, "GPU", None, [[[identifier, 0]]])
    block = ZmqEventConverter("vllm").convert(encode(s["Batch"](0.0, [stored])))[0].data.blocks[0]
    assert block.mm_keys == ((mm_key_from_text(identifier), 0),) and block.cache_salt is None


def test_bare_identifiers_are_mm_keys_and_the_salt_is_the_last_string_of_a_first_block() -> None:
    """vLLM orders a block's keys LoRA name, multimodal items, salt (on a request's first block
    only); newer vLLM sends an item as its bare identifier, without an offset."""
    s = engine_structs("vllm")
    digest = hashlib.sha256(b"image").hexdigest()
    keys = [["adapter", "sku-1", digest, "tenant"], ["sku-2"], ["adapter", digest]]
    first = s["BlockStored"]([1, 2, 3], None, [1, 2, 3, 4, 5, 6], 2, None, "GPU", "adapter", keys)
    later = s["BlockStored"]([4], 3, [7, 8], 2, None, "GPU", None, [["tenant-looking"]])
    conv = ZmqEventConverter("vllm")
    a, b = conv.convert(encode(s["Batch"](0.0, [first, later])))
    assert [(blk.mm_keys, blk.cache_salt) for blk in a.data.blocks] == [
        (((mm_key_from_text("sku-1"), 0), (bytes.fromhex(digest), 0)), "tenant"),
        (((mm_key_from_text("sku-2"), 0),), None),  # not a first block: no salt
        (((bytes.fromhex(digest), 0),), None),
    ]
    # a block with a parent is not a request's first block: its string is an identifier
    assert [(blk.mm_keys, blk.cache_salt) for blk in b.data.blocks] == [
        (((mm_key_from_text("tenant-looking"), 0),), None)
    ]
    assert not conv.stats().get("extra_keys_skipped")


def test_events_about_blocks_elsewhere_or_of_another_owner_are_counted_and_left_out() -> None:
    """vLLM's ``locality`` (REMOTE: not on this worker) and ``ownership`` (another owner's cache)
    as Dynamo reads them; an AllBlocksCleared of another owner does not clear the worker."""

    def stored(h: int, **placement: str) -> dict[str, Any]:
        return {"type": "BlockStored", "block_hashes": [h], "parent_block_hash": None, "token_ids": [1, 2],
                "block_size": 2, "lora_id": None, "medium": "GPU", "lora_name": None, **placement}  # fmt: skip

    conv = ZmqEventConverter("vllm")
    events = [
        stored(1),
        stored(2, locality="LOCAL"),
        stored(3, locality="REMOTE"),
        stored(4, ownership="kvcr"),
        {"type": "BlockRemoved", "block_hashes": [1], "medium": "GPU", "locality": "REMOTE"},
        {"type": "AllBlocksCleared", "ownership": "kvcr"},
    ]
    out = conv.convert(msgspec.msgpack.encode([1.0, events, 0]))
    assert [[b.block_hash for b in e.data.blocks] for e in out] == [[1], [2]]
    stats = conv.stats()
    assert stats["not_local"] == {
        "BlockStored locality=REMOTE": 1,
        "BlockStored ownership=kvcr": 1,
        "BlockRemoved locality=REMOTE": 1,
        "AllBlocksCleared ownership=kvcr": 1,
    }
    assert stats["unknown_fields"] == {} and stats["blocks_held"] == 2  # nothing cleared
    with pytest.raises(BridgeDecodeError):  # read whole before it is left out
        conv.convert(msgspec.msgpack.encode([1.0, [{**stored(5, locality="REMOTE"), "block_size": "x"}], 0]))
