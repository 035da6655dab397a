"""Round trips of every event type, and the wire bytes checked against the Avro spec and other readers."""

from __future__ import annotations

import io
import json
from array import array

import avro.io
import avro.schema
import fastavro
import pytest
from avro_spec_bytes import ENVELOPE_DEFAULTS, zz
from kvevents.schemas import (
    EventBatch,
    KVCacheEvent,
    KVCacheRemovedData,
    KVCacheStoredBlockData,
    KVCacheStoredData,
    RankDrops,
    codec,
    current_fingerprint,
    decode_batch,
    decode_body,
    encode_batch,
    encode_body,
)
from kvevents.schemas._avro import batch_schema_json, codec_schema, without_logical_types
from kvevents.schemas._reference import read_record


def assert_model_types(batch: EventBatch) -> None:
    """The decoded objects use the model's compact and exact types."""
    assert type(batch.events) is list and type(batch.dropped) is list
    for event in batch.events:
        data = event.data
        if isinstance(data, KVCacheStoredData):
            assert type(data.blocks) is list
            for block in data.blocks:
                assert type(block.tokens) is array and block.tokens.typecode == "i"
                extra = block.token_extra_ids
                assert extra is None or (type(extra) is array and extra.typecode == "Q")
                assert type(block.mm_keys) is tuple
                assert all(type(h) is bytes and type(o) is int for h, o in block.mm_keys)
        elif isinstance(data, KVCacheRemovedData):
            assert type(data.block_hashes) is list
            assert all(type(h) is int and 0 <= h < 2**64 for h in data.block_hashes)


def test_every_event_round_trips_alone(sample_event: KVCacheEvent, body_path: codec.BodyCodec) -> None:
    batch = EventBatch("engine-0", [sample_event])
    message = encode_batch(batch)
    assert message[:2] == b"\xc3\x01"
    assert message[2:10] == current_fingerprint()
    decoded = decode_batch(message)
    assert decoded == batch
    assert_model_types(decoded)


def test_full_batch_round_trips(full_batch: EventBatch, body_path: codec.BodyCodec) -> None:
    decoded = decode_batch(encode_batch(full_batch))
    assert decoded == full_batch
    assert_model_types(decoded)
    assert decode_body(encode_body(full_batch)) == full_batch


def test_decoding_accepts_bytearray_and_memoryview(
    full_batch: EventBatch, body_path: codec.BodyCodec
) -> None:
    message = encode_batch(full_batch)
    assert decode_batch(bytearray(message)) == full_batch
    assert decode_batch(memoryview(message)) == full_batch
    assert decode_batch(memoryview(b"xx" + message)[2:]) == full_batch


def test_all_zero_extra_ids_read_back_as_none(body_path: codec.BodyCodec) -> None:
    block = KVCacheStoredBlockData(5, [1, 2], token_extra_ids=[0, 0])
    assert block.token_extra_ids is None  # one spelling of "no extra ids"
    batch = EventBatch("i", [KVCacheEvent(1, KVCacheStoredData(None, [block]), 32)])
    assert decode_batch(encode_batch(batch)).events[0].data.blocks[0].token_extra_ids is None


def test_compiled_writes_the_bytes_fastavro_writes(sample_event: KVCacheEvent) -> None:
    batch = EventBatch("engine-0", [sample_event], sequence=3)
    assert codec._COMPILED is not None, "the compiled codec is not built; run make setup"
    compiled = codec._COMPILED.encode_body(batch)
    assert compiled == codec._REFERENCE.encode_body(batch)
    assert codec._COMPILED.decode_body(compiled) == codec._REFERENCE.decode_body(compiled) == batch


def test_compiled_and_fastavro_agree_on_the_full_batch(full_batch: EventBatch) -> None:
    assert codec._COMPILED is not None, "the compiled codec is not built; run make setup"
    body = codec._REFERENCE.encode_body(full_batch)
    assert codec._COMPILED.encode_body(full_batch) == body
    assert codec._COMPILED.encode_body(full_batch, b"prefix") == b"prefix" + body
    assert codec._COMPILED.decode_body(b"xyz" + body, 3) == full_batch


# ------------------------------------------------------------------ the bytes, from the Avro spec


def test_bytes_of_a_small_batch_follow_the_spec(body_path: codec.BodyCodec) -> None:
    batch = EventBatch(
        "a",
        [
            KVCacheEvent(1, KVCacheRemovedData([2**64 - 1, 2**63]), 32),
            KVCacheEvent(
                2,
                KVCacheStoredData(None, [KVCacheStoredBlockData(3, [1, -1, 300], cache_salt="é")]),
                32,
                attention_dp_rank=1,
            ),
        ],
    )
    expected = (
        b"\x02a"  # instance_id: length 1, "a"
        + ENVELOPE_DEFAULTS
        + zz(2)  # events: one block of two
        + zz(1)
        + zz(2)  # event_id 1, data union branch 2 (Removed)
        + zz(2)
        + zz(-1)
        + zz(-(2**63))
        + zz(0)  # 2^64-1 and 2^63 by two's complement
        + zz(32)
        + zz(0)  # window_size, attention_dp_rank null
        + zz(2)
        + zz(1)
        + zz(0)  # event_id 2, Stored, parent_hash null
        + zz(1)  # one block
        + zz(3)
        + zz(3)
        + zz(1)
        + zz(-1)
        + zz(300)
        + zz(0)  # block_hash, tokens
        + zz(0)
        + zz(0)
        + zz(35)
        + zz(0)
        + zz(0)  # lora null, level, priority, extra null, mm []
        + zz(1)
        + zz(2)
        + "é".encode()  # cache_salt: branch 1, 2 UTF-8 bytes
        + zz(0)  # end of blocks
        + zz(32)
        + zz(1)
        + zz(1)  # window_size, attention_dp_rank branch 1 = 1
        + zz(0)  # end of events
    )
    assert encode_body(batch) == expected
    assert decode_body(expected) == batch


def test_arrays_in_several_blocks_and_negative_counts_are_read(body_path: codec.BodyCodec) -> None:
    """Avro lets a writer split arrays into blocks; a negative count is followed by a byte size."""
    tokens_block_1 = zz(7) + zz(8)
    body = (
        b"\x02a"
        + zz(1)
        + zz(0)
        + zz(0)
        + zz(0)
        + zz(-1)
        + zz(len(zz(2) + zz(9)))
        + zz(2)
        + zz(9)  # dropped: block of -1 item, sized
        + zz(1)
        + zz(5)
        + zz(3)  # dropped: a second block
        + zz(0)
        + zz(0)  # first_event_block_offset
        + zz(1)  # events: first block, one event
        + zz(1)
        + zz(1)
        + zz(0)  # Stored, parent null
        + zz(1)
        + zz(4)
        + zz(-2)
        + zz(len(tokens_block_1))
        + tokens_block_1
        + zz(1)
        + zz(9)
        + zz(0)  # tokens 7 8 | 9
        + zz(0)
        + zz(0)
        + zz(35)
        + zz(1)
        + zz(2)
        + zz(1)
        + zz(2)
        + zz(1)
        + zz(3)
        + zz(0)  # extra ids in two blocks: 1 2 | 3
        + zz(0)
        + zz(0)
        + zz(0)
        + zz(32)
        + zz(0)
        + zz(-1)
        + zz(len(zz(2) + zz(2) + zz(1) + zz(5) + zz(0) + zz(32) + zz(0)))  # events: sized block
        + zz(2)
        + zz(2)
        + zz(1)
        + zz(5)
        + zz(0)
        + zz(32)
        + zz(0)  # Removed [5]
        + zz(0)
    )
    expected = EventBatch(
        "a",
        [
            KVCacheEvent(
                1,
                KVCacheStoredData(None, [KVCacheStoredBlockData(4, [7, 8, 9], token_extra_ids=[1, 2, 3])]),
                32,
            ),
            KVCacheEvent(2, KVCacheRemovedData([5]), 32),
        ],
        dropped=[RankDrops(2, 9), RankDrops(5, 3)],
    )
    assert decode_body(body) == expected


# ------------------------------------------------------------------ other Avro implementations


def _apache_schema() -> avro.schema.Schema:
    # Apache Avro's Python reader would turn created_at into a datetime; the bytes are the same.
    return avro.schema.parse(json.dumps(without_logical_types(json.loads(batch_schema_json()))))


def _untagged(value: object) -> object:
    """fastavro's (name, record) union pairs as plain records, as Apache Avro returns them."""
    if isinstance(value, tuple) and len(value) == 2 and isinstance(value[0], str):
        return _untagged(value[1])
    if isinstance(value, dict):
        return {k: _untagged(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_untagged(v) for v in value]
    return value


def test_apache_avro_reads_what_we_write(full_batch: EventBatch, body_path: codec.BodyCodec) -> None:
    body = encode_body(full_batch)
    decoder = avro.io.BinaryDecoder(io.BytesIO(body))
    record = avro.io.DatumReader(_apache_schema()).read(decoder)
    assert record == _untagged(read_record(body, codec_schema()))
    assert record["events"][6]["data"]["block_hashes"] == [0, 1, 2**63 - 1, -(2**63), -1]


def test_we_read_what_apache_avro_writes(full_batch: EventBatch, body_path: codec.BodyCodec) -> None:
    record = _untagged(read_record(codec._REFERENCE.encode_body(full_batch), codec_schema()))
    out = io.BytesIO()
    avro.io.DatumWriter(_apache_schema()).write(record, avro.io.BinaryEncoder(out))
    assert decode_body(out.getvalue()) == full_batch


def test_fingerprint_is_crc64_avro_of_the_canonical_form() -> None:
    # Apache Avro's Python library agrees once logical types are gone (it keeps
    # {"type": "long"} for an annotated long where Java and fastavro write "long").
    plain = _apache_schema()
    assert plain.fingerprint("CRC-64-AVRO") == current_fingerprint()
    parsed = fastavro.parse_schema(json.loads(batch_schema_json()))
    assert "timestamp-micros" in batch_schema_json()
    from kvevents.schemas._avro import fingerprint_of

    assert fingerprint_of(parsed) == current_fingerprint()


@pytest.mark.parametrize("n_tokens", [0, 1, 4096, 100_000])
def test_blocks_of_any_length(n_tokens: int, body_path: codec.BodyCodec) -> None:
    tokens = array("i", [(i * 7919) % 128_256 - 64 for i in range(n_tokens)])
    batch = EventBatch("i", [KVCacheEvent(1, KVCacheStoredData(1, [KVCacheStoredBlockData(2, tokens)]), 32)])
    assert decode_batch(encode_batch(batch)) == batch
