"""``kvevents export zmq``'s BlockStored.extra_keys, read back with vLLM's own struct
declarations (vllm/distributed/kv_events.py: tagged maps, and the older array_like form):
per block the LoRA name, ``(mm identifier, offset)`` per multimodal item, and the cache salt
on a request's first block, as vLLM's ``generate_block_hash_extra_keys`` orders them."""

from __future__ import annotations

from array import array
from typing import Any

import msgspec
import pytest
from kvevents.consumer import WorkerKey
from kvevents.consumer.export.convert import VllmConverter
from kvevents.consumer.export.packed import _pack_hashes, pack_tokens, py_pack_hashes, py_pack_tokens
from kvevents.consumer.export.vllm_wire import VllmWire
from kvevents.schemas import (
    EventBatch,
    KVCacheEvent,
    KVCacheEventDiff,
    KVCacheStoredBlockData,
    KVCacheStoredData,
    KVCacheUpdatedData,
)


def _vllm_structs(array_like: bool) -> Any:
    """vLLM's KVEventBatch with vLLM's fields, defaults and tags (BlockStored, BlockRemoved,
    AllBlocksCleared subclasses of a ``tag=True`` base), for decoding: events as arrays or (vLLM
    since #42892) maps, the batch an array either way (vLLM's ``EventBatch`` is ``array_like``)."""
    opts: dict[str, Any] = {"omit_defaults": True, "gc": False, "array_like": array_like, "tag": True}
    none: Any = None
    stored = msgspec.defstruct(
        "BlockStored",
        [
            ("block_hashes", list[int]),
            ("parent_block_hash", int | None),
            ("token_ids", list[int]),
            ("block_size", int),
            ("lora_id", int | None),
            ("medium", str | None),
            ("lora_name", str | None),
            ("extra_keys", list[tuple[Any, ...] | None] | None, none),
            ("group_idx", int | None, none),
            ("kv_cache_spec_kind", str | None, none),
            ("kv_cache_spec_sliding_window", int | None, none),
        ],
        **opts,
    )
    removed = msgspec.defstruct(
        "BlockRemoved",
        [("block_hashes", list[int]), ("medium", str | None), ("group_idx", int | None, none)],
        **opts,
    )
    cleared = msgspec.defstruct("AllBlocksCleared", [], **opts)
    event: Any = stored | removed | cleared
    return msgspec.defstruct(
        "KVEventBatch",
        [("ts", float), ("events", list[event]), ("data_parallel_rank", int | None, none)],
        omit_defaults=True,
        array_like=True,
    )


MM1, MM2 = bytes(range(32)), bytes(range(100, 132))


def _stored_batch() -> EventBatch:
    blocks = [
        KVCacheStoredBlockData(1, [1, 2, 3, 4], lora_id=7, mm_keys=((MM1, 2),), cache_salt="salt-1"),
        KVCacheStoredBlockData(
            2, [5, 6, 7, 8], lora_id=7, mm_keys=((MM1, -2), (MM2, 3)), cache_salt="salt-1"
        ),
        KVCacheStoredBlockData(3, [9, 10, 11, 12], lora_id=7, cache_salt="salt-1"),
    ]
    plain = [KVCacheStoredBlockData(9, [300, 70000, -5, 2**31 - 1])]
    events = [
        KVCacheEvent(0, KVCacheStoredData(None, blocks), 64, 0),
        KVCacheEvent(1, KVCacheStoredData(None, plain), 64, 0),
        KVCacheEvent(2, KVCacheUpdatedData(2, cache_level=KVCacheEventDiff(0, 1)), 64, 0),
    ]
    return EventBatch("a", events, producer_id=1, sequence=0)


@pytest.mark.parametrize("positional", [False, True])
def test_extra_keys_decode_with_vllm_structs(positional: bool) -> None:
    wire = VllmWire(positional)
    converter = VllmConverter(wire, lora_names={7: "sql-adapter"})
    out = converter.convert(_stored_batch())
    payload = wire.encode(1.5, out[WorkerKey("a", 0)], 0)
    batch = msgspec.msgpack.Decoder(_vllm_structs(positional)).decode(payload)
    stored, plain, removed, moved = batch.events
    assert stored.block_hashes == [1, 2, 3] and stored.token_ids == list(range(1, 13))
    assert stored.lora_id == 7 and stored.lora_name == "sql-adapter" and stored.medium == "GPU"
    # (an mm key's pair decodes as a list: vLLM's field is tuple[Any, ...] of untyped items);
    # the LoRA name travels in lora_name only (llm-d reads a string here as a multimodal id)
    assert stored.extra_keys == [
        ([MM1.hex(), 2], "salt-1"),  # the salt: the request's first block only
        ([MM1.hex(), -2], [MM2.hex(), 3]),
        None,
    ]
    assert plain.extra_keys is None and plain.token_ids == [300, 70000, -5, 2**31 - 1]
    assert plain.lora_id is None and plain.lora_name is None
    # a tier move re-sends the block with the same tokens and keys on the other medium
    assert (type(removed).__name__, removed.block_hashes, removed.medium) == ("BlockRemoved", [2], "GPU")
    assert (moved.block_hashes, moved.parent_block_hash, moved.medium) == ([2], 1, "CPU")
    assert moved.token_ids == [5, 6, 7, 8] and moved.block_size == 4
    assert moved.extra_keys == [([MM1.hex(), -2], [MM2.hex(), 3])]
    # group_idx has no kvevents counterpart (window sizes do not say a group's index): not sent
    assert all(getattr(e, "group_idx", None) is None for e in batch.events)


def test_extra_keys_survive_the_converter_state() -> None:
    """A restarted exporter (state reloaded) re-sends a moved block with the same extra_keys."""
    wire = VllmWire(False)
    first = VllmConverter(wire, lora_names={7: "sql-adapter"})
    batch = _stored_batch()
    first.convert(EventBatch("a", batch.events[:2], producer_id=1, sequence=0))
    again = VllmConverter(
        wire, VllmConverter.state_from_bytes(first.state_bytes()), lora_names={7: "sql-adapter"}
    )
    moved_then = first.convert(EventBatch("a", batch.events[2:], producer_id=1, sequence=1))
    moved_now = again.convert(EventBatch("a", batch.events[2:], producer_id=1, sequence=1))
    key = WorkerKey("a", 0)
    assert wire.encode(1.0, moved_now[key], 0) == wire.encode(1.0, moved_then[key], 0)


def test_without_a_lora_name_no_lora_key() -> None:
    """kvevents carries LoRA ids; without --lora-name no name goes into extra_keys."""
    wire = VllmWire(False)
    out = VllmConverter(wire).convert(_stored_batch())
    batch = msgspec.msgpack.Decoder(_vllm_structs(False)).decode(wire.encode(1.0, out[WorkerKey("a", 0)], 0))
    assert batch.events[0].extra_keys == [([MM1.hex(), 2], "salt-1"), ([MM1.hex(), -2], [MM2.hex(), 3]), None]


def test_compiled_and_python_token_packing_agree() -> None:
    """The compiled packer writes msgspec's bytes for every int width, over several arrays."""
    edges = [
        0,
        1,
        127,
        128,
        255,
        256,
        65535,
        65536,
        2**31 - 1,
        -1,
        -32,
        -33,
        -128,
        -129,
        -32768,
        -32769,
        -(2**31),
    ]
    for n in (0, 1, 15, 16, 17, 65535, 65536, 70000):
        tokens = array("i", (edges[i % len(edges)] for i in range(n)))
        parts = [tokens[: n // 3], tokens[n // 3 : n // 2], tokens[n // 2 :]]
        expected = msgspec.msgpack.encode(tokens.tolist())
        assert pack_tokens(parts) == py_pack_tokens(parts) == expected
    with pytest.raises(TypeError, match="array"):
        pack_tokens([[1, 2]])  # type: ignore[list-item]


def test_compiled_hash_packing_equals_its_twin_and_every_hash_takes_9_bytes() -> None:
    edges = [0, 1, 127, 2**32 - 1, 2**32, 2**63, 2**64 - 1]
    for n in (0, 1, 15, 16, 17, 65535, 65536, 70000):
        hashes = [edges[i % len(edges)] for i in range(n)]
        packed = _pack_hashes(hashes)
        assert packed == py_pack_hashes(hashes)
        assert msgspec.msgpack.decode(packed) == hashes
        header = 1 if n < 16 else 3 if n < 65536 else 5
        assert len(packed) == header + 9 * n and packed[header::9] == b"\xcf" * n
    with pytest.raises(OverflowError):
        _pack_hashes([2**64])


@pytest.mark.parametrize("positional", [False, True])
def test_the_bridge_reads_back_what_the_exporter_sent(positional: bool) -> None:
    """kvevents' own vLLM bridge, fed the exporter's payload, recovers each block's tokens,
    multimodal keys and cache salt (and the LoRA id): the mapping is faithful both ways."""
    from kvevents.producer.bridge import ZmqEventConverter

    wire = VllmWire(positional)
    out = VllmConverter(wire, lora_names={7: "sql-adapter"}).convert(_stored_batch())
    payload = wire.encode(1.5, out[WorkerKey("a", 0)], 0)
    events = ZmqEventConverter("vllm", window_size=64).convert(payload)
    stored = [b for e in events if isinstance(e.data, KVCacheStoredData) for b in e.data.blocks]
    original = [b for e in _stored_batch().events[:2] for b in e.data.blocks]  # type: ignore[union-attr]
    by_hash = {b.block_hash: b for b in stored}
    for block in original:
        back = by_hash[block.block_hash]
        assert back.tokens == block.tokens and back.lora_id == block.lora_id
        # offsets as sent, negative ones included (an item that began in an earlier block)
        assert back.mm_keys == block.mm_keys
        # the salt travels on a request's first block only, as vLLM sends it (the later blocks'
        # hashes depend on it through the chain), so only that block has it back
        assert back.cache_salt == ("salt-1" if block.block_hash == 1 else None)
