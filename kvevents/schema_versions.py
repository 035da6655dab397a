"""The ``EventBatch`` schema's versions: those shipped in ``schemas/avro/history/`` and the
current one, with fingerprints, the Avro compatibility of every pair (Apache Avro's own
checker, ``avro.compatibility``), and their registration in a schema registry."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvevents.schemas._avro import SCHEMA_DIR, batch_schema_json, fingerprint_of, parse_for_codec

__all__ = ["SchemaVersion", "compatibility", "register_versions", "schema_versions"]


@dataclass(frozen=True)
class SchemaVersion:
    """One version of the ``EventBatch`` schema."""

    name: str
    """``v1``, ... for shipped history files; ``current`` for the schema this release writes."""
    text: str
    source: str

    @property
    def fingerprint(self) -> str:
        """CRC-64-AVRO of the parsing canonical form, 16 hex digits (the single-object header's)."""
        return fingerprint_of(parse_for_codec(self.text)).hex()

    @property
    def canonical_size(self) -> int:
        return len(json.dumps(json.loads(self.text), separators=(",", ":")))


def schema_versions(history: Path = SCHEMA_DIR / "history") -> list[SchemaVersion]:
    """The shipped versions in order (file names ``kvevents.EventBatch.vN.avsc``), then the current."""
    versions = []
    for path in sorted(
        history.glob("kvevents.EventBatch.v*.avsc"), key=lambda p: int(p.stem.rpartition(".v")[2])
    ):
        versions.append(
            SchemaVersion(path.stem.rpartition(".")[2], path.read_text(), f"schemas/avro/history/{path.name}")
        )
    versions.append(SchemaVersion("current", batch_schema_json(), "schemas/avro/*.avsc"))
    return versions


def compatibility(reader: SchemaVersion, writer: SchemaVersion) -> list[str]:
    """Why a reader of ``reader`` cannot read data of ``writer`` (empty: it can)."""
    try:
        import avro.schema
        from avro.compatibility import ReaderWriterCompatibilityChecker, SchemaCompatibilityType
    except ImportError as exc:
        raise RuntimeError("the compatibility check needs Apache Avro: pip install 'kvevents[cli]'") from exc
    result = ReaderWriterCompatibilityChecker().get_compatibility(  # type: ignore[no-untyped-call]
        avro.schema.parse(reader.text), avro.schema.parse(writer.text)
    )
    if result.compatibility is SchemaCompatibilityType.compatible:
        return []
    return sorted(str(m) for m in result.messages) or [str(result.incompatibilities)]


def register_versions(
    registry: dict[str, Any], subject: str, versions: list[SchemaVersion], compatibility_level: str | None
) -> list[tuple[SchemaVersion, int]]:
    """Register ``versions`` in order under ``subject`` (setting ``compatibility_level`` first,
    e.g. ``FULL_TRANSITIVE``, so that the registry itself checks each against the earlier ones);
    their ids. The registry's refusal (HTTP 409) is raised as its ``SchemaRegistryError``."""
    from confluent_kafka.schema_registry import Schema, SchemaRegistryClient

    client = SchemaRegistryClient(dict(registry))
    if compatibility_level:
        client.set_compatibility(subject, compatibility_level)
    return [(v, int(client.register_schema(subject, Schema(v.text, "AVRO")))) for v in versions]
