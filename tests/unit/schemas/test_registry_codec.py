"""RegistryCodec: the Confluent wire format against confluent-kafka's in-memory (mock://) registry."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import pytest
from confluent_kafka.schema_registry import Schema, SchemaRegistryClient
from confluent_kafka.schema_registry.error import SchemaRegistryError
from kvevents.schemas import DecodeError, EventBatch, codec, encode_batch, encode_body
from kvevents.schemas._avro import batch_schema_json
from kvevents.schemas.registry import RegistryCodec

TOPIC = "kv-cache-events"


@pytest.fixture
def registry() -> SchemaRegistryClient:
    return SchemaRegistryClient.new_client({"url": "mock://registry-codec"})


def test_message_is_zero_schema_id_then_body(
    full_batch: EventBatch, body_path: codec.BodyCodec, registry: SchemaRegistryClient
) -> None:
    registry_codec = RegistryCodec(registry, TOPIC)
    message = registry_codec.encode_batch(full_batch)
    latest = registry.get_latest_version(f"{TOPIC}-value")
    assert message[0] == 0
    assert int.from_bytes(message[1:5], "big") == latest.schema_id == registry_codec.schema_id
    assert message[5:] == encode_body(full_batch)
    assert json.loads(latest.schema.schema_str) == json.loads(batch_schema_json())
    assert registry_codec.decode_batch(message) == full_batch


def test_a_reader_fetches_the_writer_schema_once(
    full_batch: EventBatch, registry: SchemaRegistryClient
) -> None:
    message = RegistryCodec(registry, TOPIC).encode_batch(full_batch)
    calls: list[int] = []
    original = registry.get_schema

    def counting_get_schema(schema_id: int, *args: Any, **kwargs: Any) -> Schema:
        calls.append(schema_id)
        return original(schema_id, *args, **kwargs)

    registry.get_schema = counting_get_schema  # type: ignore[method-assign]
    reader = RegistryCodec(registry)  # no topic: a reader only
    for _ in range(3):
        assert reader.decode_batch(message) == full_batch
    assert calls == [int.from_bytes(message[1:5], "big")]


def test_current_schema_is_read_on_the_fast_path(
    full_batch: EventBatch, registry: SchemaRegistryClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert codec._COMPILED is not None, "the compiled codec is not built; run make setup"
    monkeypatch.setattr(codec, "_BODY", codec._COMPILED)
    message = RegistryCodec(registry, TOPIC).encode_batch(full_batch)

    def no_resolution(*args: Any, **kwargs: Any) -> EventBatch:
        raise AssertionError("the current schema needs no fastavro resolution")

    monkeypatch.setattr("kvevents.schemas._reference.decode_body", no_resolution)
    assert RegistryCodec(registry).decode_batch(message) == full_batch


def test_registry_given_as_url_or_config(full_batch: EventBatch) -> None:
    for registry in ("mock://as-url", {"url": "mock://as-config"}):
        registry_codec = RegistryCodec(registry, TOPIC)
        assert registry_codec.decode_batch(registry_codec.encode_batch(full_batch)) == full_batch


def test_subject_can_be_named(full_batch: EventBatch, registry: SchemaRegistryClient) -> None:
    RegistryCodec(registry, TOPIC, subject="kvevents.EventBatch").encode_batch(full_batch)
    assert registry.get_latest_version("kvevents.EventBatch").version == 1
    with pytest.raises(SchemaRegistryError):
        registry.get_latest_version(f"{TOPIC}-value")


def test_without_auto_register_the_schema_must_exist(
    full_batch: EventBatch, registry: SchemaRegistryClient
) -> None:
    looker = RegistryCodec(registry, TOPIC, auto_register=False)
    with pytest.raises(SchemaRegistryError):
        looker.encode_batch(full_batch)
    schema_id = RegistryCodec(registry, TOPIC).schema_id
    assert looker.schema_id == schema_id
    assert looker.decode_batch(looker.encode_batch(full_batch)) == full_batch


def test_compatibility_is_set_on_the_subject_when_asked(registry: SchemaRegistryClient) -> None:
    calls: list[tuple[str | None, str | None]] = []
    registry.set_compatibility = lambda subject=None, level=None: calls.append((subject, level)) or level  # type: ignore[method-assign]
    RegistryCodec(registry, TOPIC, compatibility="FULL_TRANSITIVE").schema_id  # noqa: B018
    RegistryCodec(registry, "other").schema_id  # noqa: B018
    assert calls == [(f"{TOPIC}-value", "FULL_TRANSITIVE")]


def test_writing_needs_a_topic_or_subject(full_batch: EventBatch, registry: SchemaRegistryClient) -> None:
    with pytest.raises(ValueError, match="needs a topic or a subject"):
        RegistryCodec(registry).encode_batch(full_batch)


def test_single_object_messages_are_read_too(full_batch: EventBatch, registry: SchemaRegistryClient) -> None:
    assert RegistryCodec(registry).decode_batch(encode_batch(full_batch)) == full_batch


def test_unknown_schema_id(full_batch: EventBatch, registry: SchemaRegistryClient) -> None:
    message = b"\x00" + (4242).to_bytes(4, "big") + encode_body(full_batch)
    with pytest.raises(DecodeError, match="schema id 4242 is not in the schema registry"):
        RegistryCodec(registry).decode_batch(message)


def test_schema_that_is_not_avro(full_batch: EventBatch, registry: SchemaRegistryClient) -> None:
    json_id = registry.register_schema("json-value", Schema('{"type": "object"}', "JSON"))
    message = b"\x00" + json_id.to_bytes(4, "big") + encode_body(full_batch)
    with pytest.raises(DecodeError, match=f"schema id {json_id} is a JSON schema, not Avro"):
        RegistryCodec(registry).decode_batch(message)


@pytest.mark.parametrize(
    ("data", "pattern"),
    [
        (b"\x00\x00\x01", "shorter than the 5-byte Confluent header"),
        (b"", "0 bytes is shorter than the 5-byte Confluent header"),
        (b"\x07abcdef", "wrong magic bytes 0761"),
    ],
)
def test_bad_frames(data: bytes, pattern: str, registry: SchemaRegistryClient) -> None:
    with pytest.raises(DecodeError, match=pattern):
        RegistryCodec(registry).decode_batch(data)


def test_truncated_body_after_a_good_header(full_batch: EventBatch, registry: SchemaRegistryClient) -> None:
    registry_codec = RegistryCodec(registry, TOPIC)
    message = registry_codec.encode_batch(full_batch)
    for end in (5, 6, len(message) // 2, len(message) - 1):
        with pytest.raises(DecodeError):
            registry_codec.decode_batch(message[:end])


def test_registry_client_is_imported_only_when_used() -> None:
    """The base install (no ``registry`` extra) imports kvevents.schemas and its codec."""
    script = (
        "import sys\n"
        "import kvevents.schemas, kvevents.schemas.registry\n"
        "assert 'confluent_kafka.schema_registry' not in sys.modules, 'imported eagerly'\n"
        "kvevents.schemas.registry.RegistryCodec('mock://lazy', 't')\n"
        "assert 'confluent_kafka.schema_registry' in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", script], check=True, timeout=120)
