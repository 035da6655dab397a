"""Bodies and messages in kvevents' schema v1 (``schemas/avro/history``: the version before
producer snapshots, whose Created events have no ``snapshot`` flag), for the tests of readers
that must still take what older producers wrote."""

from __future__ import annotations

import copy
import io
from typing import Any

import fastavro
from kvevents.schemas import EventBatch, codec
from kvevents.schemas._avro import fingerprint_of, parse_for_codec
from kvevents.schemas._reference import batch_to_record

V1_FILE = codec.SCHEMA_DIR / "history" / "kvevents.EventBatch.v1.avsc"
V1_SCHEMA = parse_for_codec(V1_FILE.read_text())
V1_FINGERPRINT = fingerprint_of(V1_SCHEMA)


def without_snapshot(record: dict[str, Any]) -> dict[str, Any]:
    """A v2 record as v1 has it: every Created event's ``snapshot`` field removed."""
    record = copy.deepcopy(record)
    for event in record["events"]:
        name, data = event["data"]
        if name == "kvevents.KVCacheCreatedData":
            del data["snapshot"]
    return record


def v1_body(batch: EventBatch) -> bytes:
    """``batch``'s Avro body as a v1 writer writes it."""
    out = io.BytesIO()
    fastavro.schemaless_writer(out, V1_SCHEMA, without_snapshot(batch_to_record(batch)))
    return out.getvalue()


def v1_message(batch: EventBatch) -> bytes:
    """``batch`` as a v1 producer's single-object message."""
    return b"\xc3\x01" + V1_FINGERPRINT + v1_body(batch)
