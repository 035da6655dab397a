"""The Avro schemas, loaded and parsed once, and their single-object fingerprints.

The ``.avsc`` files in ``avro/`` are the source of truth; each named type lives in
``<namespace>.<Name>.avsc`` so that standard Avro tools (and ``fastavro.schema.load_schema``)
resolve references between them.
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path
from typing import Any

import fastavro
from fastavro.schema import load_schema, to_parsing_canonical_form

__all__ = [
    "SCHEMA_DIR",
    "batch_schema",
    "batch_schema_json",
    "codec_schema",
    "crc64_avro",
    "fingerprint_of",
    "load_batch_schema",
    "parse_for_codec",
    "without_logical_types",
]

SCHEMA_DIR = Path(__file__).with_name("avro")
_BATCH_FILE = SCHEMA_DIR / "kvevents.EventBatch.avsc"

_CRC64_EMPTY = 0xC15D213AA4D7A795


def _crc64_table() -> list[int]:
    table = []
    for i in range(256):
        fp = i
        for _ in range(8):
            fp = (fp >> 1) ^ (_CRC64_EMPTY & -(fp & 1))
        table.append(fp)
    return table


_CRC64_TABLE = _crc64_table()


def crc64_avro(data: bytes) -> int:
    """The Avro spec's CRC-64-AVRO (Rabin) fingerprint of ``data``."""
    fp = _CRC64_EMPTY
    for byte in data:
        fp = (fp >> 8) ^ _CRC64_TABLE[(fp ^ byte) & 0xFF]
    return fp


def fingerprint_of(parsed_schema: Any) -> bytes:
    """8-byte little-endian CRC-64-AVRO of a schema's parsing canonical form."""
    canonical = to_parsing_canonical_form(parsed_schema)
    return crc64_avro(canonical.encode("utf-8")).to_bytes(8, "little")


def without_logical_types(schema: Any) -> Any:
    """A copy of a schema's JSON with every ``logicalType`` annotation removed.

    The model keeps ``created_at`` as integer microseconds; fastavro would turn a
    ``timestamp-micros`` into a ``datetime`` (and fail outside years 1..9999). Logical types are
    not part of the parsing canonical form, so the fingerprint and the bytes are unchanged.
    """
    if isinstance(schema, dict):
        return {k: without_logical_types(v) for k, v in schema.items() if k != "logicalType"}
    if isinstance(schema, list):
        return [without_logical_types(v) for v in schema]
    return schema


def parse_for_codec(schema: dict[str, Any] | str) -> Any:
    """Parse a schema (JSON text or object) the way the fastavro codec reads and writes it."""
    obj = json.loads(schema) if isinstance(schema, str) else schema
    return fastavro.parse_schema(without_logical_types(obj))


@cache
def codec_schema() -> Any:
    """The ``EventBatch`` schema as the fastavro codec uses it (no logical types), parsed once."""
    return parse_for_codec(json.loads(batch_schema_json()))


@cache
def batch_schema() -> Any:
    """The parsed ``kvevents.EventBatch`` schema (every named type resolved), parsed once."""
    return fastavro.parse_schema(load_schema(str(_BATCH_FILE), _write_hint=False))


@cache
def batch_schema_json() -> str:
    """The full ``EventBatch`` schema as one self-contained JSON document (for registries)."""
    return json.dumps(load_batch_schema(SCHEMA_DIR))


def load_batch_schema(directory: Path) -> Any:
    """The ``EventBatch`` schema of the ``.avsc`` files in ``directory`` as one JSON object."""
    return load_schema(str(directory / _BATCH_FILE.name), _write_hint=False)
