"""Schema v2 (``KVCacheCreatedData.snapshot``) against the shipped v1, in both directions.

v1 is the schema kvevents shipped before producer snapshots (``avro/history``); v2 adds one
boolean with a default. Old writer -> new reader: the field reads as False. New writer -> old
reader: the field is skipped, so a snapshot reads as a plain Created run followed by Stored
events, which an old index applies as a reset and a refill.
"""

from __future__ import annotations

import io
import json
from typing import Any

import fastavro
import pytest
from confluent_kafka.schema_registry import Schema, SchemaRegistryClient
from kvevents.schemas import (
    DecodeError,
    EventBatch,
    KVCacheCreatedData,
    KVCacheEvent,
    codec,
    current_fingerprint,
    decode_batch,
    decode_record,
    encode_batch,
)
from kvevents.schemas._avro import batch_schema_json, fingerprint_of, parse_for_codec
from kvevents.schemas._reference import batch_to_record
from kvevents.schemas.registry import RegistryCodec
from schema_v1 import v1_message, without_snapshot

V1_FILE = codec.SCHEMA_DIR / "history" / "kvevents.EventBatch.v1.avsc"
V1_FINGERPRINT = bytes.fromhex("edf02289072c3f09")  # what kvevents 0.1 wrote (pinned in the index core)


def v1() -> dict[str, Any]:
    return json.loads(V1_FILE.read_text())


def _current() -> dict[str, Any]:
    return json.loads(batch_schema_json())


def as_v1_reader_sees_it(batch: EventBatch) -> EventBatch:
    """``batch`` with every snapshot flag at the default a v1 reader fills in (False)."""
    events = [
        KVCacheEvent(
            e.event_id,
            KVCacheCreatedData(e.data.num_blocks_per_cache_level),
            e.window_size,
            e.attention_dp_rank,
        )
        if isinstance(e.data, KVCacheCreatedData)
        else e
        for e in batch.events
    ]
    return EventBatch(
        batch.instance_id,
        events,
        batch.attention_dp_size,
        batch.producer_id,
        batch.sequence,
        batch.created_at_us,
        batch.dropped,
        batch.first_event_block_offset,
    )


def test_the_shipped_v1_is_the_previous_schema_and_known_at_import() -> None:
    assert fingerprint_of(parse_for_codec(v1())) == V1_FINGERPRINT
    assert current_fingerprint() != V1_FINGERPRINT
    assert V1_FINGERPRINT in codec._WRITERS


def _record(schema: Any, name: str) -> dict[str, Any]:
    """The named record ``name`` (short name) anywhere in a schema's JSON."""
    if isinstance(schema, dict):
        if schema.get("type") == "record" and schema["name"].rsplit(".", 1)[-1] == name:
            return schema
        children = list(schema.values())
    elif isinstance(schema, list):
        children = schema
    else:
        children = []
    for child in children:
        found = _record(child, name) if isinstance(child, (dict, list)) else None
        if found:
            return found
    return {}


def test_the_current_schema_adds_only_a_defaulted_boolean() -> None:
    old, new = _record(v1(), "KVCacheCreatedData"), _record(_current(), "KVCacheCreatedData")
    assert [f["name"] for f in new["fields"]] == [*(f["name"] for f in old["fields"]), "snapshot"]
    added = new["fields"][-1]
    assert (added["type"], added["default"]) == ("boolean", False)


# ------------------------------------------------------------------ old writer -> new reader


def test_new_reader_reads_v1_messages_with_snapshot_false(
    full_batch: EventBatch, body_path: codec.BodyCodec
) -> None:
    expected = as_v1_reader_sees_it(full_batch)
    assert any(isinstance(e.data, KVCacheCreatedData) for e in expected.events)
    assert decode_batch(v1_message(full_batch)) == expected


# ------------------------------------------------------------------ new writer -> old reader


def test_v1_reader_reads_v2_messages_and_skips_the_flag(
    full_batch: EventBatch, body_path: codec.BodyCodec
) -> None:
    assert any(getattr(e.data, "snapshot", False) for e in full_batch.events)
    record = decode_record(encode_batch(full_batch), v1())
    assert record == without_snapshot(batch_to_record(full_batch))


def test_a_pure_v1_reader_reads_v2_bytes() -> None:
    """A reader that knows only v1, with plain fastavro (as a kvevents 0.1 consumer would)."""
    batch = EventBatch(
        "i",
        [
            KVCacheEvent(3, KVCacheCreatedData([8, 2], True), 64),
            KVCacheEvent(4, KVCacheCreatedData([1]), 128),
        ],
    )
    message = encode_batch(batch)
    writer = parse_for_codec(_current())
    record = fastavro.schemaless_reader(
        io.BytesIO(message[10:]), writer, parse_for_codec(v1()), return_record_name=True
    )
    assert [e["data"] for e in record["events"]] == [
        ("kvevents.KVCacheCreatedData", {"num_blocks_per_cache_level": [8, 2]}),
        ("kvevents.KVCacheCreatedData", {"num_blocks_per_cache_level": [1]}),
    ]


# ------------------------------------------------------------------ through a schema registry


@pytest.fixture
def registry() -> SchemaRegistryClient:
    return SchemaRegistryClient.new_client({"url": "mock://snapshot-evolution"})


def test_through_a_registry_v1_and_v2_read_each_other(
    full_batch: EventBatch, registry: SchemaRegistryClient
) -> None:
    subject = "kv-cache-events-value"
    v1_id = registry.register_schema(subject, Schema(json.dumps(v1()), "AVRO"))
    v2_codec = RegistryCodec(registry, "kv-cache-events")
    assert v2_codec.schema_id != v1_id
    old_message = b"\x00" + v1_id.to_bytes(4, "big") + v1_message(full_batch)[10:]
    assert v2_codec.decode_batch(old_message) == as_v1_reader_sees_it(full_batch)
    new_message = v2_codec.encode_batch(full_batch)
    assert RegistryCodec(registry).decode_record(new_message, json.dumps(v1())) == without_snapshot(
        batch_to_record(full_batch)
    )


def test_v1_bodies_are_read_by_the_compiled_reader_not_fastavro(
    full_batch: EventBatch, monkeypatch: pytest.MonkeyPatch, registry: SchemaRegistryClient
) -> None:
    """fastavro's resolution of a v1 body took 18x the compiled reader's time and ~110 bytes of
    memory per byte of a message of tiny events (1M events in 5 MB: 9 s, +562 MB)."""
    from kvevents.schemas import _reference

    assert codec.fast_path_enabled()

    def refuse(*args: object) -> None:
        raise AssertionError("fastavro read a v1 body")

    monkeypatch.setattr(_reference, "decode_body", refuse)
    expected = as_v1_reader_sees_it(full_batch)
    assert decode_batch(v1_message(full_batch)) == expected
    assert codec.decode_body(v1_message(full_batch)[10:], codec._WRITERS[V1_FINGERPRINT]) == expected
    v1_id = registry.register_schema("kv-cache-events-value", Schema(json.dumps(v1()), "AVRO"))
    framed = b"\x00" + v1_id.to_bytes(4, "big") + v1_message(full_batch)[10:]
    assert RegistryCodec(registry, "kv-cache-events").decode_batch(framed) == expected
    with pytest.raises(DecodeError, match="trailing bytes"):
        decode_batch(v1_message(full_batch) + b"\x00")
