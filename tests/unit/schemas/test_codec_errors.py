"""Bad bytes raise DecodeError saying what was wrong; bad values raise EncodeError naming the field."""

from __future__ import annotations

import tracemalloc
from array import array
from typing import Any

import pytest
from avro_spec_bytes import ENVELOPE_DEFAULTS, zz
from kvevents.schemas import (
    DecodeError,
    EncodeError,
    EventBatch,
    KVCacheCreatedData,
    KVCacheEvent,
    KVCacheEventDiff,
    KVCacheRemovedData,
    KVCacheStoredBlockData,
    KVCacheStoredData,
    KVCacheUpdatedData,
    RankDrops,
    codec,
    current_fingerprint,
    decode_batch,
    decode_body,
    encode_batch,
    encode_body,
)
from msgspec.structs import force_setattr


def compiled() -> codec.BodyCodec:
    assert codec._COMPILED is not None, "the compiled codec is not built; run make setup"
    return codec._COMPILED


HEAD = b"\x02a" + ENVELOPE_DEFAULTS + zz(1)
"""An EventBatch body up to its first event, of one."""


def body_with_event(event: bytes) -> bytes:
    """An EventBatch body around one hand-written event."""
    return HEAD + event + zz(0)


def stored_event(block: bytes) -> bytes:
    """A Stored event (id 1, parent null, window 32) around one hand-written block."""
    return zz(1) + zz(1) + zz(0) + zz(1) + block + zz(0) + zz(32) + zz(0)


BLOCK_HEAD = zz(3) + zz(2) + zz(5) + zz(6) + zz(0)  # block_hash 3, tokens [5, 6]
BLOCK_TAIL = zz(0) + zz(0) + zz(35) + zz(0) + zz(0) + zz(0)  # lora, level, priority, extra, mm, salt


def test_hand_written_block_is_valid() -> None:
    """The fragments below are right, so each malformed variant differs by one fault only."""
    expected = KVCacheStoredBlockData(3, [5, 6])
    assert compiled().decode_body(body_with_event(stored_event(BLOCK_HEAD + BLOCK_TAIL))).events[
        0
    ].data.blocks == [expected]


# ------------------------------------------------------------------ decoding, compiled: the message says what


MALFORMED: list[tuple[str, bytes, str]] = [
    ("empty", b"", r"truncated Avro body: instance_id runs past the end \(at byte 0 of 0\)"),
    ("negative string length", zz(-1) + b"a", r"instance_id: negative string length -1"),
    ("string longer than the body", zz(10) + b"abc", r"truncated Avro body: instance_id runs past the end"),
    ("invalid UTF-8", zz(2) + b"\xff\xfe" + ENVELOPE_DEFAULTS + zz(0), r"instance_id: invalid UTF-8"),
    (
        "data union index past the end",
        body_with_event(zz(1) + zz(4) + bytes(6)),
        r"events\[0\]\.data: invalid union index 4 \(the union has 4 branches\)",
    ),
    (
        "negative union index",
        body_with_event(zz(1) + zz(-1) + bytes(6)),
        r"events\[0\]\.data: invalid union index -1",
    ),
    (
        "optional field union index 2",
        body_with_event(zz(1) + zz(2) + zz(0) + zz(32) + zz(2)),
        r"events\[0\]\.attention_dp_rank: invalid union index 2 \(the union has 2 branches\)",
    ),
    (
        "truncated inside tokens",
        HEAD + zz(1) + zz(1) + zz(0) + zz(1) + zz(3) + zz(4) + zz(300) * 3 + b"\x80",
        r"truncated Avro body: events\[0\]\.data\.blocks\[0\]\.tokens runs past the end",
    ),
    (
        "forged event count",
        b"\x02a" + ENVELOPE_DEFAULTS + zz(2**40) + zz(0),
        r"events: array block of 1099511627776 items cannot fit in the 1 bytes left",
    ),
    (
        "forged token count",
        body_with_event(stored_event(zz(3) + zz(2**60) + zz(5))),
        r"events\[0\]\.data\.blocks\[0\]\.tokens: array block of 1152921504606846976 items cannot fit",
    ),
    (
        "trailing bytes",
        body_with_event(zz(1) + zz(2) + zz(0) + zz(32) + zz(0)) + b"\x00\x00",
        r"2 trailing bytes after the Avro body",
    ),
    (
        "varint beyond 64 bits",
        body_with_event(b"\xff" * 10 + b"\x01"),
        r"events\[0\]\.event_id: varint does not fit in 64 bits",
    ),
    (
        "int beyond 32 bits",
        body_with_event(zz(1) + zz(2) + zz(0) + zz(2**31) + zz(0)),
        r"events\[0\]\.window_size: 2147483648 is outside the Avro int range",
    ),
    (
        "token beyond 32 bits",
        body_with_event(stored_event(zz(3) + zz(1) + zz(-(2**31) - 1) + zz(0) + BLOCK_TAIL)),
        r"events\[0\]\.data\.blocks\[0\]\.tokens: -2147483649 is outside the Avro int range",
    ),
    (
        "negative array block size",
        body_with_event(zz(1) + zz(2) + zz(-1) + zz(-5) + zz(9) + zz(0) + zz(32) + zz(0)),
        r"events\[0\]\.data\.block_hashes: negative array block size -5",
    ),
    (
        "array block size that does not match",
        body_with_event(zz(1) + zz(2) + zz(-1) + zz(2) + zz(9) + zz(0) + zz(32) + zz(0)),
        r"events\[0\]\.data\.block_hashes: array block size does not match its items",
    ),
    (
        "extra ids for fewer tokens",
        body_with_event(
            stored_event(BLOCK_HEAD + zz(0) + zz(0) + zz(35) + zz(1) + zz(1) + zz(7) + zz(0) + zz(0) + zz(0))
        ),
        r"events\[0\]\.data\.blocks\[0\]\.token_extra_ids: 1 ids for 2 tokens \(one per token\)",
    ),
    (
        "truncated multimodal hash",
        HEAD
        + zz(1)
        + zz(1)
        + zz(0)
        + zz(1)
        + BLOCK_HEAD
        + zz(0)
        + zz(0)
        + zz(35)
        + zz(0)
        + zz(1)
        + b"\x01" * 20,
        r"events\[0\]\.data\.blocks\[0\]\.mm_keys: array block of 1 items cannot fit",
    ),
    (
        "invalid UTF-8 in a salt",
        body_with_event(
            stored_event(BLOCK_HEAD + zz(0) + zz(0) + zz(35) + zz(0) + zz(0) + zz(1) + zz(1) + b"\x80")
        ),
        r"events\[0\]\.data\.blocks\[0\]\.cache_salt: invalid UTF-8",
    ),
    (
        "dropped drops out",
        b"\x02a" + zz(1) + zz(0) + zz(0) + zz(0) + zz(1) + zz(3) + b"\x80",
        r"truncated Avro body: dropped\[0\]\.dropped_events runs past the end",
    ),
    (
        "diff value cut off",
        HEAD + zz(1) + zz(3) + zz(7) + zz(1) + zz(0),
        r"truncated Avro body: events\[0\]\.data\.cache_level\.new_value runs past the end",
    ),
]


@pytest.mark.parametrize(
    ("body", "pattern"), [(b, p) for _, b, p in MALFORMED], ids=[n for n, _, _ in MALFORMED]
)
def test_compiled_decoder_names_the_fault(body: bytes, pattern: str) -> None:
    with pytest.raises(DecodeError, match=pattern):
        compiled().decode_body(body)


LENIENT_IN_FASTAVRO = {
    # fastavro reads these without complaint (a negative union index picks a branch from the
    # end, ints are not range-checked, block sizes are not checked, a negative string length
    # reads to the end): only the compiled reader rejects them.
    "negative union index",
    "negative string length",
    "int beyond 32 bits",
    "token beyond 32 bits",
    "array block size that does not match",
    "negative array block size",
}


@pytest.mark.parametrize(
    "body",
    [b for n, b, _ in MALFORMED if n not in LENIENT_IN_FASTAVRO],
    ids=[n for n, _, _ in MALFORMED if n not in LENIENT_IN_FASTAVRO],
)
def test_both_decoders_reject(body: bytes, body_path: codec.BodyCodec) -> None:
    with pytest.raises(DecodeError):
        decode_body(body)
    with pytest.raises(DecodeError):
        decode_batch(b"\xc3\x01" + current_fingerprint() + body)


def test_every_truncation_of_a_message_is_a_decode_error(
    full_batch: EventBatch, body_path: codec.BodyCodec
) -> None:
    message = encode_batch(full_batch)
    for end in range(len(message)):
        with pytest.raises(DecodeError):
            decode_batch(message[:end])


def test_a_forged_count_allocates_nothing_big() -> None:
    body = body_with_event(stored_event(zz(3) + zz(2**40) + b"\x02" * 64))
    tracemalloc.start()
    try:
        with pytest.raises(DecodeError, match="cannot fit"):
            compiled().decode_body(body)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 64 * 1024


@pytest.mark.parametrize("value", [123, "text", None, [1, 2], memoryview(array("i", [1, 2])).cast("B")[:0]])
def test_decoding_non_bytes_is_a_decode_error(value: Any, body_path: codec.BodyCodec) -> None:
    with pytest.raises(DecodeError):
        decode_batch(value)


def test_compiled_decode_body_rejects_non_buffers_and_bad_offsets() -> None:
    with pytest.raises(DecodeError, match="expected bytes, got int"):
        compiled().decode_body(5)
    with pytest.raises(DecodeError, match="offset 9 is outside the 3 bytes"):
        compiled().decode_body(b"abc", 9)


# ------------------------------------------------------------------ framing


def test_wrong_magic(full_batch: EventBatch) -> None:
    message = encode_batch(full_batch)
    with pytest.raises(DecodeError, match="wrong magic bytes c302: expected c301"):
        decode_batch(b"\xc3\x02" + message[2:])


def test_unknown_fingerprint_names_it_and_the_way_out(full_batch: EventBatch) -> None:
    message = encode_batch(full_batch)
    forged = b"\xc3\x01" + bytes.fromhex("0011223344556677") + message[10:]
    with pytest.raises(
        DecodeError, match=r"unknown schema fingerprint 0011223344556677.*register_writer_schema"
    ):
        decode_batch(forged)


def test_confluent_magic_without_a_registry(full_batch: EventBatch) -> None:
    body = encode_body(full_batch)
    with pytest.raises(DecodeError, match=r"Confluent wire format \(schema id 258\) needs a schema registry"):
        decode_batch(b"\x00\x00\x00\x01\x02" + body)


@pytest.mark.parametrize(
    ("data", "pattern"),
    [
        (b"", "shorter than any framing header"),
        (b"\xc3", "shorter than any framing header"),
        (b"\xc3\x01\x00\x01", "truncated single-object header: 4 bytes, the header needs 10"),
    ],
)
def test_short_headers(data: bytes, pattern: str) -> None:
    with pytest.raises(DecodeError, match=pattern):
        decode_batch(data)


def test_single_object_header_is_magic_then_fingerprint(
    full_batch: EventBatch, body_path: codec.BodyCodec
) -> None:
    message = encode_batch(full_batch)
    assert message == b"\xc3\x01" + current_fingerprint() + encode_body(full_batch)
    assert len(current_fingerprint()) == 8


# ------------------------------------------------------------------ encoding: both paths, same message


class Index:
    """An integer-like object (as numpy's integers are): it has ``__index__``."""

    def __init__(self, value: int) -> None:
        self.value = value

    def __index__(self) -> int:
        return self.value


def _block(**changes: Any) -> KVCacheStoredBlockData:
    block = KVCacheStoredBlockData(1, [1, 2])
    for name, value in changes.items():
        force_setattr(block, name, value)  # past the model's own conversion, as a buggy caller could
    return block


def _stored(block: KVCacheStoredBlockData) -> KVCacheEvent:
    return KVCacheEvent(1, KVCacheStoredData(None, [KVCacheStoredBlockData(9, []), block]), 32)


def _batch(*events: Any, **fields: Any) -> EventBatch:
    return EventBatch(fields.pop("instance_id", "i"), list(events), **fields)


BAD_VALUES: list[tuple[str, Any, str]] = [
    (
        "negative block hash",
        _batch(_stored(KVCacheStoredBlockData(-1, [1]))),
        "events[0].data.blocks[1].block_hash: -1 is outside the unsigned 64-bit range 0..2^64-1",
    ),
    (
        "block hash 2^64",
        _batch(_stored(KVCacheStoredBlockData(2**64, [1]))),
        "events[0].data.blocks[1].block_hash: 18446744073709551616 is outside the unsigned 64-bit range 0..2^64-1",
    ),
    (
        "parent hash 2^64",
        _batch(KVCacheEvent(1, KVCacheStoredData(2**64, []), 32)),
        "events[0].data.parent_hash: 18446744073709551616 is outside the unsigned 64-bit range 0..2^64-1",
    ),
    (
        "removed hash -1",
        _batch(KVCacheEvent(1, KVCacheRemovedData([5, -1]), 32)),
        "events[0].data.block_hashes[1]: -1 is outside the unsigned 64-bit range 0..2^64-1",
    ),
    (
        "updated hash not an integer",
        _batch(KVCacheEvent(1, KVCacheUpdatedData("abc"), 32)),
        "events[0].data.block_hash: expected an integer, got str",
    ),
    (
        "lora id -1",
        _batch(_stored(KVCacheStoredBlockData(1, [1], lora_id=-1))),
        "events[0].data.blocks[1].lora_id: -1 is outside the unsigned 64-bit range 0..2^64-1",
    ),
    (
        "window size beyond int32",
        _batch(KVCacheEvent(1, KVCacheRemovedData([]), 2**31)),
        "events[0].window_size: 2147483648 is outside the Avro int range -2^31..2^31-1",
    ),
    (
        "window size a float",
        _batch(KVCacheEvent(1, KVCacheRemovedData([]), 1.5)),
        "events[0].window_size: expected an integer, got float",
    ),
    (
        "attention dp rank below int32",
        _batch(KVCacheEvent(1, KVCacheRemovedData([]), 32, -(2**31) - 1)),
        "events[0].attention_dp_rank: -2147483649 is outside the Avro int range -2^31..2^31-1",
    ),
    (
        "event id 2^63",
        _batch(KVCacheRemovedData([]), KVCacheEvent(2**63, KVCacheRemovedData([]), 32)),
        "events[0]: expected a KVCacheEvent, got KVCacheRemovedData",
    ),
    (
        "event id beyond long",
        _batch(KVCacheEvent(2**63, KVCacheRemovedData([]), 32)),
        "events[0].event_id: 9223372036854775808 is outside the Avro long range -2^63..2^63-1",
    ),
    (
        "priority a string",
        _batch(_stored(_block(priority="high"))),
        "events[0].data.blocks[1].priority: expected an integer, got str",
    ),
    (
        "cache level beyond int32",
        _batch(_stored(_block(cache_level=2**31))),
        "events[0].data.blocks[1].cache_level: 2147483648 is outside the Avro int range -2^31..2^31-1",
    ),
    (
        "token beyond int32",
        _batch(_stored(_block(tokens=[1, 2**31]))),
        "events[0].data.blocks[1].tokens[1]: 2147483648 is outside the Avro int range -2^31..2^31-1",
    ),
    (
        "extra ids of another length",
        _batch(_stored(_block(token_extra_ids=array("Q", [1])))),
        "events[0].data.blocks[1].token_extra_ids: 1 ids for 2 tokens (one per token)",
    ),
    (
        "extra id -1",
        _batch(_stored(_block(token_extra_ids=[1, -1]))),
        "events[0].data.blocks[1].token_extra_ids[1]: -1 is outside the unsigned 64-bit range 0..2^64-1",
    ),
    (
        "multimodal hash of 31 bytes",
        _batch(_stored(_block(mm_keys=((b"x" * 31, 0),)))),
        "events[0].data.blocks[1].mm_keys[0].hash: expected 32 bytes, got b'xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx'",
    ),
    (
        "multimodal key not a pair",
        _batch(_stored(_block(mm_keys=(b"x" * 32,)))),
        "events[0].data.blocks[1].mm_keys[0]: expected a (hash, start_offset) pair",
    ),
    (
        "multimodal offset beyond int32",
        _batch(_stored(_block(mm_keys=((b"x" * 32, 2**31),)))),
        "events[0].data.blocks[1].mm_keys[0].start_offset: 2147483648 is outside the Avro int range -2^31..2^31-1",
    ),
    (
        "salt not a str",
        _batch(_stored(_block(cache_salt=b"salt"))),
        "events[0].data.blocks[1].cache_salt: expected a str, got bytes",
    ),
    (
        "salt with a lone surrogate",
        _batch(_stored(_block(cache_salt="a\ud800"))),
        "events[0].data.blocks[1].cache_salt: not encodable as UTF-8 (surrogates not allowed)",
    ),
    (
        "block not a block",
        _batch(KVCacheEvent(1, KVCacheStoredData(None, [None]), 32)),
        "events[0].data.blocks[0]: expected a KVCacheStoredBlockData, got NoneType",
    ),
    (
        "blocks not a sequence",
        _batch(KVCacheEvent(1, KVCacheStoredData(None, 5), 32)),
        "events[0].data.blocks: expected a sequence, got int",
    ),
    (
        "diff value beyond int32",
        _batch(KVCacheEvent(1, KVCacheUpdatedData(1, priority=KVCacheEventDiff(35, 2**31)), 32)),
        "events[0].data.priority.new_value: 2147483648 is outside the Avro int range -2^31..2^31-1",
    ),
    (
        "diff not a diff",
        _batch(KVCacheEvent(1, KVCacheUpdatedData(1, cache_level=(0, 1)), 32)),
        "events[0].data.cache_level: expected a KVCacheEventDiff or None, got tuple",
    ),
    (
        "created levels beyond int32",
        _batch(KVCacheEvent(1, KVCacheCreatedData([1, 2**31]), 32)),
        "events[0].data.num_blocks_per_cache_level[1]: 2147483648 is outside the Avro int range -2^31..2^31-1",
    ),
    (
        "unknown data type",
        _batch(KVCacheEvent(1, {"type": "stored"}, 32)),
        "events[0].data: unknown event data type dict",
    ),
    ("instance id bytes", _batch(instance_id=b"engine"), "instance_id: expected a str, got bytes"),
    (
        "instance id lone surrogate",
        _batch(instance_id="\udcff"),
        "instance_id: not encodable as UTF-8 (surrogates not allowed)",
    ),
    (
        "attention dp size beyond int32",
        _batch(attention_dp_size=2**31),
        "attention_dp_size: 2147483648 is outside the Avro int range -2^31..2^31-1",
    ),
    (
        "created_at beyond long",
        _batch(created_at_us=-(2**63) - 1),
        "created_at_us: -9223372036854775809 is outside the Avro long range -2^63..2^63-1",
    ),
    (
        "dropped events beyond long",
        _batch(dropped=[RankDrops(0, 1), RankDrops(1, 2**63)]),
        "dropped[1].dropped_events: 9223372036854775808 is outside the Avro long range -2^63..2^63-1",
    ),
    ("dropped not RankDrops", _batch(dropped=[(0, 1)]), "dropped[0]: expected a RankDrops, got tuple"),
    ("not a batch", {"instance_id": "i", "events": []}, "expected an EventBatch, got dict"),
]


@pytest.mark.parametrize(
    ("batch", "message"), [(b, m) for _, b, m in BAD_VALUES], ids=[n for n, _, _ in BAD_VALUES]
)
def test_encode_error_names_the_field(batch: Any, message: str, body_path: codec.BodyCodec) -> None:
    with pytest.raises(EncodeError) as raised:
        encode_batch(batch)
    assert str(raised.value) == message


def test_integer_like_values_are_integers(body_path: codec.BodyCodec) -> None:
    """Objects with ``__index__`` (numpy's integers) encode as the integers they stand for."""
    plain = _batch(KVCacheEvent(7, KVCacheRemovedData([2**64 - 1]), 32, 1), sequence=5)
    like = _batch(
        KVCacheEvent(Index(7), KVCacheRemovedData([Index(2**64 - 1)]), Index(32), Index(1)), sequence=Index(5)
    )
    assert encode_batch(like) == encode_batch(plain)


def test_sequences_other_than_lists_encode_like_lists(body_path: codec.BodyCodec) -> None:
    as_lists = _batch(
        KVCacheEvent(1, KVCacheRemovedData([1, 2, 3]), 32), KVCacheEvent(2, KVCacheCreatedData([4]), 32)
    )
    as_others = _batch(
        KVCacheEvent(1, KVCacheRemovedData(h for h in (1, 2, 3)), 32),
        KVCacheEvent(2, KVCacheCreatedData((4,)), 32),
    )
    force_setattr(as_others, "events", tuple(as_others.events))
    assert encode_batch(as_others) == encode_batch(as_lists)


def test_model_rejects_mismatched_extra_ids_and_short_hashes() -> None:
    with pytest.raises(ValueError, match="token_extra_ids has 1 ids for 2 tokens"):
        KVCacheStoredBlockData(1, [1, 2], token_extra_ids=[5])
    with pytest.raises(ValueError, match="a multimodal hash has 32 bytes, got 3"):
        KVCacheStoredBlockData(1, [1], mm_keys=((b"abc", 0),))
    with pytest.raises(TypeError, match="a multimodal hash must be bytes, not int"):
        KVCacheStoredBlockData(1, [1], mm_keys=((32, 0),))
