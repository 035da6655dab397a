"""The compiled core reads Avro bodies itself: same results as decode_batch, same errors, and
nothing applied when the bytes are bad."""

from __future__ import annotations

import io
import json

import fastavro
import pytest
from _index_helpers import batch, block, created, removed, stored, stored_blocks, updated
from kvevents.consumer import CacheIndex
from kvevents.schemas import DecodeError, codec, current_fingerprint, encode_batch, register_writer_schema
from kvevents.schemas._avro import batch_schema_json
from kvevents.schemas._reference import batch_to_record


def rich_batch():
    return batch(
        [
            created(0),
            stored_blocks(
                1,
                [
                    block(
                        2**64 - 1,
                        lora_id=2**63 + 5,
                        cache_salt="ü",
                        token_extra_ids=[0, 1, 0, 2**64 - 1],
                        mm_keys=((bytes(range(32)), -3),),
                    ),
                    block(2**63),
                ],
            ),
            removed(2, [2**63]),
            updated(3, 2**64 - 1, level=(0, 1), priority=(1, 99)),
            stored(4, [5], parent=2**64 - 1),
        ],
        3,
        pid=-(2**63),
        dropped=[(0, 0)],
    )


def test_the_fused_reader_reads_the_current_schema():
    """The compiled codec's flat reader (which the index core cimports) matches the .avsc."""
    assert current_fingerprint() in codec.flat_variants()


def test_fused_reader_equals_decode_then_apply(core):
    data = encode_batch(rich_batch())
    fused, reference = CacheIndex(core="compiled"), CacheIndex(core=core)
    fused.apply_encoded(data)
    reference.apply(rich_batch())
    assert fused.to_bytes() == reference.to_bytes()
    assert fused.stats().counters == reference.stats().counters


@pytest.mark.parametrize("cut", range(1, 40))
def test_truncated_bytes_raise_and_apply_nothing(core, cut):
    index = CacheIndex(core=core)
    index.apply(batch([created(0), stored(1, [7])], 0))
    before = index.to_bytes()
    data = encode_batch(rich_batch())
    with pytest.raises(DecodeError):
        index.apply_encoded(data[: len(data) - cut * 7])
    assert index.to_bytes() == before


def test_bad_framing_raises_decode_errors(core):
    index = CacheIndex(core=core)
    data = encode_batch(rich_batch())
    with pytest.raises(DecodeError, match="trailing bytes"):
        index.apply_encoded(data + b"\x00")
    with pytest.raises(DecodeError, match="magic"):
        index.apply_encoded(b"\xc4\x01" + data[2:])
    with pytest.raises(DecodeError, match="unknown schema fingerprint"):
        index.apply_encoded(data[:2] + bytes(8) + data[10:])
    with pytest.raises(DecodeError, match="expected bytes"):
        index.apply_encoded("text")  # type: ignore[arg-type]
    assert index.workers() == []


def test_bad_union_index_is_reported(core):
    data = bytearray(encode_batch(batch([updated(0, 5)], 0)))
    # the event's data union index sits after instance id, envelope fields and event id
    pos = data.index(bytes([0x06]), 10 + 3 + 6)  # union branch 3 (zigzag 6): Updated
    data[pos] = 0x10  # branch 8 does not exist
    with pytest.raises(DecodeError):
        CacheIndex(core=core).apply_encoded(bytes(data))


def test_other_schema_versions_go_through_schema_resolution(core):
    old = json.loads(batch_schema_json())
    old["fields"] = [f for f in old["fields"] if f["name"] != "first_event_block_offset"]
    fingerprint = register_writer_schema(old)
    parsed = fastavro.parse_schema(old)
    body = io.BytesIO()
    record = batch_to_record(rich_batch())
    del record["first_event_block_offset"]
    fastavro.schemaless_writer(body, parsed, record)
    index, reference = CacheIndex(core=core), CacheIndex(core=core)
    index.apply_encoded(b"\xc3\x01" + fingerprint + body.getvalue())
    reference.apply(rich_batch())
    assert index.to_bytes() == reference.to_bytes()
