"""Encode and decode ``EventBatch`` messages: Avro binary bodies in a self-describing frame.

Single-object framing (``C3 01``, the 8-byte CRC-64-AVRO fingerprint, the body) by default; the
Confluent wire format through :mod:`.registry`. Bodies of the current schema go through the
compiled ``_fastcodec`` when built, else fastavro (the reference, :mod:`._reference`; forced by
``KVEVENTS_PURE_PYTHON=1``); other schema versions are resolved by fastavro. Framing, codecs and
evolution: ``docs/WIRE_FORMAT.md`` and ``schemas/avro/README.md``.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any, Protocol

from fastavro.schema import to_parsing_canonical_form

from . import _reference
from ._avro import SCHEMA_DIR, batch_schema, batch_schema_json, codec_schema, fingerprint_of, parse_for_codec
from ._probe import compiled_mismatch, without_field
from .errors import DecodeError, EncodeError
from .model import EventBatch

__all__ = [
    "CONFLUENT_MAGIC",
    "CONTENT_TYPE",
    "SINGLE_OBJECT_HEADER",
    "SINGLE_OBJECT_MAGIC",
    "BodyCodec",
    "current_fingerprint",
    "decode_batch",
    "decode_body",
    "decode_record",
    "encode_batch",
    "encode_body",
    "envelope_of",
    "fast_path_enabled",
    "flat_variants",
    "pure_python_forced",
    "register_shipped_versions",
    "register_writer_schema",
]

log = logging.getLogger(__name__)

SINGLE_OBJECT_MAGIC = b"\xc3\x01"
"""The first two bytes of an Avro single-object encoded message."""
CONFLUENT_MAGIC = 0
"""The first byte of a Confluent wire-format message (then a 4-byte big-endian schema id)."""
CONTENT_TYPE = "application/vnd.kvevents.batch+avro"
"""Content type the Kafka sink puts in the ``content-type`` header."""

SINGLE_OBJECT_HEADER = len(SINGLE_OBJECT_MAGIC) + 8
"""Bytes before the Avro body of a single-object message: the magic, then the fingerprint."""
_SINGLE_OBJECT_HEADER = SINGLE_OBJECT_HEADER


class BodyCodec(Protocol):
    """Writes and reads Avro bodies of the current schema (the fast path's interface)."""

    def encode_body(self, batch: EventBatch, prefix: bytes = b"") -> bytes:
        """``prefix`` followed by the Avro body of ``batch``."""
        ...

    def decode_body(self, body: bytes | bytearray | memoryview, offset: int = 0) -> EventBatch:
        """The batch whose body starts at ``body[offset]`` and runs to the end."""
        ...


class _FastavroBodyCodec:
    """The reference body codec, on fastavro."""

    def __init__(self, schema: Any) -> None:
        self._schema = schema

    def encode_body(self, batch: EventBatch, prefix: bytes = b"") -> bytes:
        body = _reference.encode_body(batch, self._schema)
        return prefix + body if prefix else body

    def decode_body(self, body: bytes | bytearray | memoryview, offset: int = 0) -> EventBatch:
        return _reference.decode_body(memoryview(body)[offset:] if offset else body, self._schema)


def pure_python_forced() -> bool:
    """Whether ``KVEVENTS_PURE_PYTHON`` (set, and not "0") asks every compiled fast path (codec,
    engine recorder, index core) to step aside for its pure-Python twin."""
    return os.environ.get("KVEVENTS_PURE_PYTHON", "") not in ("", "0")


def _load_compiled(reference: BodyCodec) -> Any | None:
    """The compiled codec when it is built and writes and reads what ``reference`` does."""
    try:
        from . import _fastcodec
    except ImportError:
        log.debug("kvevents.schemas._fastcodec is not built; using fastavro")
        return None
    problem = compiled_mismatch(_fastcodec, reference)
    if problem is not None:
        log.warning(
            "kvevents.schemas._fastcodec does not implement the schema in %s (%s); "
            "using fastavro until the fast path is updated",
            SCHEMA_DIR,
            problem,
        )
        return None
    return _fastcodec


_SCHEMA = codec_schema()
_FINGERPRINT = fingerprint_of(batch_schema())
_HEADER = SINGLE_OBJECT_MAGIC + _FINGERPRINT
_REFERENCE: BodyCodec = _FastavroBodyCodec(_SCHEMA)
_COMPILED: Any | None = _load_compiled(_REFERENCE)
_BODY: BodyCodec = _REFERENCE if pure_python_forced() or _COMPILED is None else _COMPILED
_WRITERS: dict[bytes, Any] = {_FINGERPRINT: _SCHEMA}
_EVENTS_LAST = json.loads(batch_schema_json())["fields"][-1]["name"] == "events"
_CANONICAL = to_parsing_canonical_form(_SCHEMA)
_CANONICAL_NO_SNAPSHOT = to_parsing_canonical_form(
    parse_for_codec(without_field(json.loads(batch_schema_json()), "KVCacheCreatedData", "snapshot"))
)


def fast_path_enabled() -> bool:
    """Whether bodies of the current schema go through the compiled codec."""
    return _BODY is not _REFERENCE


def current_fingerprint() -> bytes:
    """The 8-byte CRC-64-AVRO fingerprint of the schema this version writes."""
    return _FINGERPRINT


def flat_variants() -> dict[bytes, int]:
    """The known writer schemas the compiled flat reader (``_fastcodec.flat_read``, used by the
    compiled index core) reads, by fingerprint, with the variant to read them with.

    Found by comparing parsing canonical forms: the current schema, and any registered version
    equal to it without ``KVCacheCreatedData.snapshot`` (v1). Empty when the compiled codec is
    not built or does not match the ``.avsc`` files.
    """
    if _COMPILED is None:
        return {}
    variants: dict[bytes, int] = {}
    for fingerprint, writer in _WRITERS.items():
        canonical = to_parsing_canonical_form(writer)
        if canonical == _CANONICAL:
            variants[fingerprint] = _COMPILED.FLAT_VARIANT_CURRENT
        elif canonical == _CANONICAL_NO_SNAPSHOT:
            variants[fingerprint] = _COMPILED.FLAT_VARIANT_NO_SNAPSHOT
    return variants


def envelope_of(empty_message: bytes) -> bytes:
    """What precedes the events array in every message with the envelope of ``empty_message``
    (the encoded batch with that envelope and no events, in any framing).

    ``envelope_of(encode(envelope)) + events`` is the message of the batch with those events,
    where ``events`` is an events array cut from another message after its own envelope: an
    Avro record is its fields' encodings in order, ``events`` is the schema's last field and an
    empty array is the single byte ``00``. Raises :class:`EncodeError` when the schema does not
    end with ``events`` (the producer's sink then re-encodes instead of splicing).
    """
    if not _EVENTS_LAST:
        raise EncodeError("the EventBatch schema does not end with its events array: no splicing")
    if not empty_message.endswith(b"\x00"):
        raise EncodeError("not a batch without events: its encoding does not end with an empty array")
    return empty_message[:-1]


def register_writer_schema(schema: dict[str, Any] | str) -> bytes:
    """Make another version of the ``EventBatch`` schema readable; returns its fingerprint.

    Single-object messages name their writer schema only by fingerprint, so a reader must
    know that schema: versions this package shipped are known, others (say, a newer
    producer's) are registered here, or read through a schema registry instead.
    """
    parsed = parse_for_codec(schema)
    fingerprint = fingerprint_of(parsed)
    _WRITERS.setdefault(fingerprint, parsed)
    return fingerprint


def register_shipped_versions(directory: Path = SCHEMA_DIR / "history") -> list[bytes]:
    """Register every earlier ``EventBatch`` schema shipped in ``directory``; their fingerprints.

    Each ``*.avsc`` there is one full, self-contained schema of a released version (see
    ``avro/README.md``); this runs at import so single-object readers know them all.
    """
    return [register_writer_schema(path.read_text()) for path in sorted(directory.glob("*.avsc"))]


register_shipped_versions()


def encode_body(batch: EventBatch) -> bytes:
    """The Avro binary body of ``batch`` under the current schema, without framing."""
    return _BODY.encode_body(batch)


def decode_body(body: bytes | bytearray | memoryview, writer_schema: Any | None = None) -> EventBatch:
    """Read an Avro body; ``writer_schema`` (parsed) when another schema version wrote it."""
    if writer_schema is None or writer_schema is _SCHEMA:
        return _BODY.decode_body(body)
    return decode_other_body(body, 0, writer_schema)


def decode_other_body(body: bytes | bytearray | memoryview, offset: int, writer_schema: Any) -> EventBatch:
    """The batch whose body, written with ``writer_schema`` (another version), starts at
    ``body[offset]``: the compiled reader's for v1 (the current schema without
    ``KVCacheCreatedData.snapshot``), fastavro's resolution otherwise (18x slower on v1, and
    ~110 bytes of memory per byte of a message of tiny events)."""
    if fast_path_enabled() and _writes_v1(writer_schema):
        compiled: Any = _COMPILED  # its decode_body reads v1 too (the protocol's does not say)
        batch: EventBatch = compiled.decode_body(body, offset, True)
        return batch
    return _reference.decode_body(memoryview(body)[offset:] if offset else body, writer_schema, _SCHEMA)


_V1_WRITERS: dict[int, tuple[Any, bool]] = {}


def _writes_v1(writer_schema: Any) -> bool:
    """Whether ``writer_schema`` is the current schema without the snapshot flag (cached per
    parsed schema: its canonical form costs a walk of the schema)."""
    known = _V1_WRITERS.get(id(writer_schema))
    if known is None or known[0] is not writer_schema:
        if len(_V1_WRITERS) >= 1024:  # registry writers come and go
            _V1_WRITERS.clear()
        known = (writer_schema, to_parsing_canonical_form(writer_schema) == _CANONICAL_NO_SNAPSHOT)
        _V1_WRITERS[id(writer_schema)] = known
    return known[1]


def encode_batch(batch: EventBatch) -> bytes:
    """``batch`` as an Avro single-object encoded message."""
    return _BODY.encode_body(batch, _HEADER)


def _as_bytes_view(data: Any) -> bytes | bytearray | memoryview:
    if isinstance(data, (bytes, bytearray)):
        return data
    if isinstance(data, memoryview):
        try:
            return data.cast("B") if data.format != "B" or data.ndim != 1 else data
        except TypeError as exc:
            raise DecodeError(
                f"expected contiguous bytes, got a {data.format!r} memoryview ({exc})"
            ) from None
    raise DecodeError(f"expected bytes, got {type(data).__name__}")


def _writer_of(view: bytes | bytearray | memoryview) -> tuple[bytes, Any]:
    """The fingerprint and parsed writer schema of a single-object message; DecodeError if none."""
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
        return fingerprint, writer
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


def decode_batch(data: bytes | bytearray | memoryview) -> EventBatch:
    """Decode a single-object encoded message; raise :class:`DecodeError` saying what was wrong."""
    view = _as_bytes_view(data)
    fingerprint, writer = _writer_of(view)
    if fingerprint == _FINGERPRINT:
        return _BODY.decode_body(view, _SINGLE_OBJECT_HEADER)
    return decode_other_body(view, _SINGLE_OBJECT_HEADER, writer)


def decode_record(
    data: bytes | bytearray | memoryview, reader_schema: dict[str, Any] | str | None = None
) -> Any:
    """Decode a single-object message into a plain Avro record, resolved to ``reader_schema``.

    For tools and for readers of another schema version: the result is fastavro's record
    (union branches as ``(record name, record)`` pairs, hashes as signed longs), read with
    the writer's schema and resolved to ``reader_schema`` (JSON text or object; the current
    schema when None).
    """
    view = _as_bytes_view(data)
    _, writer = _writer_of(view)
    reader = _SCHEMA if reader_schema is None else parse_for_codec(reader_schema)
    return _reference.read_record(memoryview(view)[_SINGLE_OBJECT_HEADER:], writer, reader)
