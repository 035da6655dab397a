"""Hypothesis: the compiled codec equals fastavro on any batch, and no input makes a decoder misbehave."""

from __future__ import annotations

import contextlib
from datetime import timedelta
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
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
)
from msgspec.structs import force_setattr

U64_EDGES = [0, 1, 2**63 - 1, 2**63, 2**64 - 1]
u64 = st.sampled_from(U64_EDGES) | st.integers(0, 2**64 - 1)
i32 = st.sampled_from([-(2**31), -1, 0, 2**31 - 1]) | st.integers(-(2**31), 2**31 - 1)
i64 = st.sampled_from([-(2**63), -1, 0, 2**63 - 1]) | st.integers(-(2**63), 2**63 - 1)
token_ids = st.integers(0, 128_255) | i32


@st.composite
def blocks(draw: st.DrawFn) -> KVCacheStoredBlockData:
    tokens = draw(st.lists(token_ids, max_size=40))
    extra = draw(st.none() | st.lists(u64, min_size=len(tokens), max_size=len(tokens)))
    return KVCacheStoredBlockData(
        draw(u64),
        tokens,
        lora_id=draw(st.none() | u64),
        cache_level=draw(i32),
        priority=draw(i32),
        token_extra_ids=extra,
        mm_keys=tuple(draw(st.lists(st.tuples(st.binary(min_size=32, max_size=32), i32), max_size=3))),
        cache_salt=draw(st.none() | st.text(max_size=20)),
    )


diffs = st.none() | st.builds(KVCacheEventDiff, i32, i32)
event_data = st.one_of(
    st.builds(KVCacheCreatedData, st.lists(i32, max_size=4), st.booleans()),
    st.builds(KVCacheStoredData, st.none() | u64, st.lists(blocks(), max_size=4)),
    st.builds(KVCacheRemovedData, st.lists(u64, max_size=10)),
    st.builds(KVCacheUpdatedData, u64, diffs, diffs),
)
events = st.builds(KVCacheEvent, i64, event_data, i32, st.none() | i32)
batches = st.builds(
    EventBatch,
    st.text(max_size=30),
    st.lists(events, max_size=8),
    attention_dp_size=i32,
    producer_id=i64,
    sequence=i64,
    created_at_us=i64,
    dropped=st.lists(st.builds(RankDrops, i32, i64), max_size=3),
    first_event_block_offset=i32,
)


def compiled() -> codec.BodyCodec:
    assert codec._COMPILED is not None, "the compiled codec is not built; run make setup"
    return codec._COMPILED


REFERENCE = codec._REFERENCE


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
@given(batches)
def test_compiled_writes_fastavros_bytes_and_both_read_them_back(batch: EventBatch) -> None:
    body = REFERENCE.encode_body(batch)
    assert compiled().encode_body(batch) == body
    from_compiled = compiled().decode_body(body)
    assert from_compiled == REFERENCE.decode_body(body) == batch
    assert [type(e.data) for e in from_compiled.events] == [type(e.data) for e in batch.events]


@settings(max_examples=200, suppress_health_check=[HealthCheck.too_slow])
@given(batches, st.binary(max_size=12))
def test_compiled_reads_v1_bodies_as_fastavros_resolution_does(batch: EventBatch, tail: bytes) -> None:
    """Schema v1 (no snapshot flag) through the compiled reader equals fastavro's resolution to
    the current schema, for whole bodies and damaged ones (a DecodeError both, or equal)."""
    from kvevents.schemas import _reference
    from schema_v1 import V1_SCHEMA, v1_body

    body = v1_body(batch)
    assert compiled().decode_body(body, 0, True) == _reference.decode_body(body, V1_SCHEMA, codec._SCHEMA)  # type: ignore[call-arg]
    for damaged in (body[: len(body) // 2], body + tail if tail else body[:-1]):
        try:
            want: object = _reference.decode_body(damaged, V1_SCHEMA, codec._SCHEMA)
        except DecodeError:  # fastavro's own errors, wrapped
            want = DecodeError
        try:
            got: object = compiled().decode_body(damaged, 0, True)  # type: ignore[call-arg]
        except DecodeError:
            got = DecodeError
        assert got == want


# ------------------------------------------------------------------ fuzzing: only DecodeError, quickly

FUZZ = settings(max_examples=400, deadline=timedelta(seconds=1), suppress_health_check=[HealthCheck.too_slow])


def decode_or_error(body_codec: codec.BodyCodec, data: bytes) -> EventBatch | DecodeError:
    """The decoded batch, or the DecodeError; any other exception fails the test."""
    try:
        result = body_codec.decode_body(data)
    except DecodeError as exc:
        assert str(exc), "a DecodeError says what was wrong"
        return exc
    assert type(result) is EventBatch
    return result


def check_decoders(data: bytes) -> None:
    fast = decode_or_error(compiled(), data)
    reference = decode_or_error(REFERENCE, data)
    if isinstance(fast, EventBatch):
        # The compiled reader is the stricter one: what it accepts, fastavro reads the same.
        assert reference == fast


@FUZZ
@given(st.binary(max_size=600))
def test_random_bytes_only_raise_decode_error(data: bytes) -> None:
    check_decoders(data)
    for message in (data, b"\xc3\x01" + current_fingerprint() + data):
        with contextlib.suppress(DecodeError):
            codec.decode_batch(message)  # through the framing, on the default path


mutations = st.lists(
    st.tuples(
        st.sampled_from(["flip", "set", "insert", "delete", "truncate", "repeat"]),
        st.integers(0, 10**6),
        st.binary(min_size=1, max_size=8),
    ),
    min_size=1,
    max_size=4,
)


def mutate(data: bytes, ops: list[tuple[str, int, bytes]]) -> bytes:
    buf = bytearray(data)
    for op, where, payload in ops:
        at = where % (len(buf) + 1)
        if op == "flip" and buf:
            buf[at % len(buf)] ^= payload[0] or 1
        elif op == "set" and buf:
            buf[at % len(buf)] = payload[0]
        elif op == "insert":
            buf[at:at] = payload
        elif op == "delete":
            del buf[at : at + len(payload)]
        elif op == "truncate":
            del buf[at:]
        elif op == "repeat":
            buf[at:at] = buf[at : at + 4 * len(payload)]
    return bytes(buf)


@FUZZ
@given(batches, mutations)
def test_mutated_messages_only_raise_decode_error(
    batch: EventBatch, ops: list[tuple[str, int, bytes]]
) -> None:
    check_decoders(mutate(REFERENCE.encode_body(batch), ops))


@FUZZ
@given(batches, st.integers(0, 10**6))
def test_truncated_messages_raise_decode_error(batch: EventBatch, cut: int) -> None:
    body = REFERENCE.encode_body(batch)
    end = cut % len(body)
    for body_codec in (compiled(), REFERENCE):
        with pytest.raises(DecodeError):
            body_codec.decode_body(body[:end])


# ------------------------------------------------------------------ bad values: same verdict on both paths


class Index:
    """An integer-like object (as numpy's integers are)."""

    def __init__(self, value: int) -> None:
        self.value = value

    def __index__(self) -> int:
        return self.value

    def __repr__(self) -> str:
        return f"Index({self.value})"


odd_values = st.sampled_from(
    [
        None,
        1.5,
        "x",
        b"xyz",
        -1,
        2**31,
        2**63,
        2**64,
        -(2**63) - 1,
        True,
        [],
        (),
        [1, "a"],
        Index(3),
        Index(2**64),
    ]
)


def fields_of(batch: EventBatch) -> list[tuple[Any, str]]:
    """Every (struct, field name) reachable from ``batch``."""
    found: list[tuple[Any, str]] = []

    def walk(obj: Any) -> None:
        for name in obj.__struct_fields__:
            found.append((obj, name))
            value = getattr(obj, name)
            children = value if isinstance(value, list) else [value]
            for child in children:
                if hasattr(child, "__struct_fields__"):
                    walk(child)

    walk(batch)
    return found


def encode_outcome(body_codec: codec.BodyCodec, batch: EventBatch) -> bytes | str:
    try:
        return body_codec.encode_body(batch)
    except EncodeError as exc:
        return f"EncodeError: {exc}"


@settings(max_examples=400, suppress_health_check=[HealthCheck.too_slow])
@given(batches, st.data())
def test_a_bad_value_anywhere_gets_the_same_verdict_on_both_paths(
    batch: EventBatch, data: st.DataObject
) -> None:
    target, name = data.draw(st.sampled_from(fields_of(batch)))
    force_setattr(target, name, data.draw(odd_values))
    assert encode_outcome(compiled(), batch) == encode_outcome(REFERENCE, batch)
