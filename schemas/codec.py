"""Encode and decode ``EventBatch`` messages: Avro binary bodies in a self-describing frame.

Framing. By default a message is an Avro *single-object encoding*: the two bytes ``C3 01``, the
8-byte little-endian CRC-64-AVRO fingerprint of the writer schema, then the Avro binary body.
The fingerprint tells a reader which schema wrote the body. With a schema registry
(:class:`kvevents.schemas.registry.RegistryCodec`) messages use the Confluent wire format
instead: a zero byte, the 4-byte big-endian schema id, then the body.

Bodies written with the current schema are read by the compiled fast path when it is built
(``kvevents.schemas._fastcodec``) and by fastavro otherwise; both produce the same bytes and
objects (fastavro is the reference, and the test oracle). A body written with another known
schema version is resolved to the current one by fastavro (schema evolution).
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any, Protocol

import fastavro

from . import _reference
from ._avro import batch_schema, fingerprint_of
from .errors import DecodeError
from .model import EventBatch

__all__ = [
    "CONTENT_TYPE",
    "CONFLUENT_MAGIC",
    "SINGLE_OBJECT_MAGIC",
    "BodyCodec",
    "current_fingerprint",
    "decode_batch",
    "decode_body",
    "encode_batch",
    "encode_body",
    "fast_path_enabled",
    "register_writer_schema",
]

log = logging.getLogger(__name__)

SINGLE_OBJECT_MAGIC = b"\xc3\x01"
"""The first two bytes of an Avro single-object encoded message."""
CONFLUENT_MAGIC = 0
"""The first byte of a Confluent wire-format message (then a 4-byte big-endian schema id)."""
CONTENT_TYPE = "application/vnd.kvevents.batch+avro"
"""Content type the Kafka sink puts in the ``content-type`` header."""

_SINGLE_OBJECT_HEADER = 10


class BodyCodec(Protocol):
    """Writes and reads Avro bodies of the current schema (the fast path's interface)."""

    def encode_body(self, batch: EventBatch) -> bytes: ...

    def decode_body(self, body: bytes | memoryview) -> EventBatch: ...


class _FastavroBodyCodec:
    """The reference body codec, on fastavro."""

    def __init__(self, schema: Any) -> None:
        self._schema = schema

    def encode_body(self, batch: EventBatch) -> bytes:
        return _reference.encode_body(batch, self._schema)

    def decode_body(self, body: bytes | memoryview) -> EventBatch:
        return _reference.decode_body(body, self._schema)


def _load_body_codec() -> BodyCodec:
    reference = _FastavroBodyCodec(batch_schema())
    if os.environ.get("KVEVENTS_PURE_PYTHON"):
        return reference
    try:
        from . import _fastcodec  # type: ignore[attr-defined]
    except ImportError:
        log.debug("kvevents.schemas._fastcodec is not built; using fastavro")
        return reference
    return _fastcodec  # type: ignore[return-value]


_SCHEMA = batch_schema()
_FINGERPRINT = fingerprint_of(_SCHEMA)
_BODY: BodyCodec = _load_body_codec()
_WRITERS: dict[bytes, Any] = {_FINGERPRINT: _SCHEMA}


def fast_path_enabled() -> bool:
    """Whether bodies of the current schema go through the compiled codec."""
    return not isinstance(_BODY, _FastavroBodyCodec)


def current_fingerprint() -> bytes:
    """The 8-byte CRC-64-AVRO fingerprint of the schema this version writes."""
    return _FINGERPRINT


def register_writer_schema(schema: dict[str, Any] | str) -> bytes:
    """Make another version of the ``EventBatch`` schema readable; returns its fingerprint.

    Single-object messages name their writer schema only by fingerprint, so a reader must
    know that schema: versions this package shipped are known, others (say, a newer
    producer's) are registered here, or read through a schema registry instead.
    """
    parsed = fastavro.parse_schema(json.loads(schema) if isinstance(schema, str) else schema)
    fingerprint = fingerprint_of(parsed)
    _WRITERS[fingerprint] = parsed
    return fingerprint


def encode_body(batch: EventBatch) -> bytes:
    """The Avro binary body of ``batch`` under the current schema, without framing."""
    return _BODY.encode_body(batch)


def decode_body(body: bytes | memoryview, writer_schema: Any | None = None) -> EventBatch:
    """Read an Avro body; ``writer_schema`` (parsed) when another schema version wrote it."""
    if writer_schema is None or writer_schema is _SCHEMA:
        return _BODY.decode_body(body)
    return _reference.decode_body(body, writer_schema, _SCHEMA)


def encode_batch(batch: EventBatch) -> bytes:
    """``batch`` as an Avro single-object encoded message."""
    return SINGLE_OBJECT_MAGIC + _FINGERPRINT + _BODY.encode_body(batch)


def decode_batch(data: bytes | bytearray | memoryview) -> EventBatch:
    """Decode a single-object encoded message; raise :class:`DecodeError` saying what was wrong."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise DecodeError(f"expected bytes, got {type(data).__name__}")
    view = memoryview(data)
    if len(view) < 2:
        raise DecodeError(f"truncated: {len(view)} bytes is shorter than any framing header")
    if view[0] == 0xC3 and view[1] == 0x01:
        if len(view) < _SINGLE_OBJECT_HEADER:
            raise DecodeError(
                f"truncated single-object header: {len(view)} bytes, the header needs {_SINGLE_OBJECT_HEADER}"
            )
        fingerprint = bytes(view[2:_SINGLE_OBJECT_HEADER])
        writer = _WRITERS.get(fingerprint)
        if writer is None:
            raise DecodeError(
                f"unknown schema fingerprint {fingerprint.hex()} (this reader knows "
                f"{', '.join(f.hex() for f in _WRITERS)}); register the writer's schema "
                "with register_writer_schema() or use a schema registry"
            )
        return decode_body(view[_SINGLE_OBJECT_HEADER:], writer)
    if view[0] == CONFLUENT_MAGIC:
        schema_id = int.from_bytes(view[1:5], "big") if len(view) >= 5 else None
        raise DecodeError(
            f"Confluent wire format (schema id {schema_id}) needs a schema registry: "
            "decode with kvevents.schemas.registry.RegistryCodec"
        )
    raise DecodeError(
        f"wrong magic bytes {bytes(view[:2]).hex()}: expected c301 (Avro single-object) "
        "or 00 (Confluent wire format)"
    )
