"""Schema evolution: a v2 with added defaulted fields reads v1 data, and v1 reads v2 data.

Both framings: single-object (the reader registers the writer's schema) and the Confluent wire
format with a schema registry (the reader fetches it by id).
"""

from __future__ import annotations

import copy
import io
import json
from pathlib import Path
from typing import Any

import fastavro
import pytest
from confluent_kafka.schema_registry import Schema, SchemaRegistryClient
from kvevents.schemas import (
    DecodeError,
    EventBatch,
    codec,
    current_fingerprint,
    decode_batch,
    decode_record,
    encode_batch,
    register_writer_schema,
)
from kvevents.schemas._avro import batch_schema_json, fingerprint_of, parse_for_codec
from kvevents.schemas._reference import batch_to_record
from kvevents.schemas.registry import RegistryCodec

ENGINE_DEFAULT = "unknown"
BLOCK_SIZE_DEFAULT = 32


def _records(schema: Any) -> dict[str, dict[str, Any]]:
    """Every named record of a schema's JSON, by full name."""
    found: dict[str, dict[str, Any]] = {}

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            if node.get("type") == "record":
                found[node["name"]] = node
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(schema)
    return found


def v1() -> dict[str, Any]:
    return json.loads(batch_schema_json())


def v2(*, with_defaults: bool = True) -> dict[str, Any]:
    """The next version: an envelope field and a nested block field, both added with defaults."""
    schema = copy.deepcopy(v1())
    records = _records(schema)
    engine = {"name": "engine", "type": "string", "doc": "Engine name and version."}
    block_size = {"name": "block_size", "type": "int", "doc": "Tokens per block."}
    if with_defaults:
        engine["default"] = ENGINE_DEFAULT
        block_size["default"] = BLOCK_SIZE_DEFAULT
    records["kvevents.EventBatch"]["fields"].append(engine)
    records["kvevents.KVCacheStoredBlockData"]["fields"].append(block_size)
    return schema


def v2_record(batch: EventBatch) -> dict[str, Any]:
    """What a v2 producer writes for ``batch``: the v1 record plus the new fields, set."""
    record = batch_to_record(batch)
    record["engine"] = "trtllm-2.0"
    for event in record["events"]:
        name, data = event["data"]
        for block in data.get("blocks", []) if name == "kvevents.KVCacheStoredData" else []:
            block["block_size"] = 16
    return record


def v2_body(batch: EventBatch) -> bytes:
    out = io.BytesIO()
    fastavro.schemaless_writer(out, parse_for_codec(v2()), v2_record(batch))
    return out.getvalue()


def without_v2_fields(record: dict[str, Any]) -> dict[str, Any]:
    """A v2 record with the added fields checked for their defaults and then removed."""
    record = copy.deepcopy(record)
    assert record.pop("engine") == ENGINE_DEFAULT
    for event in record["events"]:
        name, data = event["data"]
        for block in data.get("blocks", []) if name == "kvevents.KVCacheStoredData" else []:
            assert block.pop("block_size") == BLOCK_SIZE_DEFAULT
    return record


def test_v2_is_a_different_schema() -> None:
    assert fingerprint_of(parse_for_codec(v2())) != current_fingerprint()


# ------------------------------------------------------------------ single-object framing


def test_v1_reads_what_v2_writes_once_the_schema_is_registered(
    full_batch: EventBatch, body_path: codec.BodyCodec, fresh_writers: dict[bytes, object]
) -> None:
    v2_fingerprint = fingerprint_of(parse_for_codec(v2()))
    message = b"\xc3\x01" + v2_fingerprint + v2_body(full_batch)
    with pytest.raises(DecodeError, match=f"unknown schema fingerprint {v2_fingerprint.hex()}"):
        decode_batch(message)
    assert register_writer_schema(json.dumps(v2())) == v2_fingerprint
    assert decode_batch(message) == full_batch


def test_shipped_versions_are_known_at_import(
    full_batch: EventBatch, tmp_path: Path, fresh_writers: dict[bytes, object]
) -> None:
    (tmp_path / "kvevents.EventBatch.v2.avsc").write_text(json.dumps(v2()))
    v2_fingerprint = fingerprint_of(parse_for_codec(v2()))
    assert codec.register_shipped_versions(tmp_path) == [v2_fingerprint]
    assert decode_batch(b"\xc3\x01" + v2_fingerprint + v2_body(full_batch)) == full_batch


def test_v2_reads_what_v1_writes(full_batch: EventBatch, body_path: codec.BodyCodec) -> None:
    record = decode_record(encode_batch(full_batch), v2())
    assert without_v2_fields(record) == batch_to_record(full_batch)


def test_an_added_field_without_a_default_breaks_old_data(full_batch: EventBatch) -> None:
    """Why the rule requires defaults: a reader cannot fill the field in for old messages."""
    with pytest.raises(DecodeError, match=r"No default value for field (engine|block_size)"):
        decode_record(encode_batch(full_batch), v2(with_defaults=False))


def test_a_removed_field_without_a_default_breaks_new_data(
    full_batch: EventBatch, fresh_writers: dict[bytes, object]
) -> None:
    """Why nothing is removed unless it has a default: old readers need a value for it."""
    schema = v1()
    event = _records(schema)["kvevents.KVCacheEvent"]
    event["fields"] = [f for f in event["fields"] if f["name"] != "window_size"]
    record = batch_to_record(full_batch)
    for e in record["events"]:
        del e["window_size"]
    out = io.BytesIO()
    fastavro.schemaless_writer(out, parse_for_codec(schema), record)
    fingerprint = register_writer_schema(schema)
    with pytest.raises(DecodeError, match="window_size"):
        decode_batch(b"\xc3\x01" + fingerprint + out.getvalue())


# ------------------------------------------------------------------ schema registry


@pytest.fixture
def registry() -> SchemaRegistryClient:
    return SchemaRegistryClient.new_client({"url": "mock://evolution"})


def test_v1_reads_what_v2_writes_through_the_registry(
    full_batch: EventBatch, body_path: codec.BodyCodec, registry: SchemaRegistryClient
) -> None:
    v1_codec = RegistryCodec(registry, "kv-cache-events")
    v1_id = v1_codec.schema_id
    v2_id = registry.register_schema("kv-cache-events-value", Schema(json.dumps(v2()), "AVRO"))
    assert v2_id != v1_id
    message = b"\x00" + v2_id.to_bytes(4, "big") + v2_body(full_batch)
    assert v1_codec.decode_batch(message) == full_batch
    assert RegistryCodec(registry).decode_batch(message) == full_batch  # a reader that never wrote


def test_v2_reads_what_v1_writes_through_the_registry(
    full_batch: EventBatch, body_path: codec.BodyCodec, registry: SchemaRegistryClient
) -> None:
    message = RegistryCodec(registry, "kv-cache-events").encode_batch(full_batch)
    record = RegistryCodec(registry).decode_record(message, json.dumps(v2()))
    assert without_v2_fields(record) == batch_to_record(full_batch)
