"""Adding a field costs edits to the schema, the model and the codec only (issue 16, item 1).

The test plays the change on a copy of the schema: one optional field appended to
``EventBatch``'s envelope (before ``events``), a model that carries it, and the reference codec
taught to write and read it. Everything else is left as it is and must keep working: the
fingerprint follows from the ``.avsc`` copy, the compiled codec notices it no longer matches
(and would step aside), consumers read the new messages through schema resolution into the
same index state, and the producer's splicing still holds.
"""

from __future__ import annotations

import io
import json
import shutil
from pathlib import Path
from typing import Any

import fastavro
import msgspec
import pytest
from kvevents.consumer import CacheIndex
from kvevents.schemas import EventBatch, codec, encode_batch, register_writer_schema
from kvevents.schemas._avro import SCHEMA_DIR, fingerprint_of, load_batch_schema, parse_for_codec
from kvevents.schemas._probe import PROBE, compiled_mismatch
from kvevents.schemas._reference import batch_from_record, batch_to_record, read_record

NOTE = {"name": "note", "type": ["null", "string"], "default": None, "doc": "A field added in a test."}


class NotedBatch(EventBatch, frozen=True, gc=False):
    """The model edit: the batch with the new field."""

    note: str | None = None


def _plain(batch: EventBatch) -> EventBatch:
    return EventBatch(**{name: getattr(batch, name) for name in EventBatch.__struct_fields__})


class NotedReference:
    """The codec edit: the reference body codec writes and reads ``note`` too."""

    def __init__(self, schema: Any) -> None:
        self.schema = schema

    def encode_body(self, batch: EventBatch, prefix: bytes = b"") -> bytes:
        record = batch_to_record(_plain(batch))
        record["note"] = getattr(batch, "note", None)
        out = io.BytesIO()
        fastavro.schemaless_writer(out, self.schema, record)
        return prefix + out.getvalue()

    def decode_body(self, body: bytes | memoryview, offset: int = 0) -> NotedBatch:
        record = read_record(memoryview(body)[offset:], self.schema)
        base = batch_from_record(record)
        return NotedBatch(**msgspec.structs.asdict(base), note=record["note"])


@pytest.fixture(name="edited_schema")
def edited_schema_fixture(tmp_path: Path) -> Any:
    """The schema edit, on a copy of ``schemas/avro``: ``note`` before ``events``."""
    copy = tmp_path / "avro"
    shutil.copytree(SCHEMA_DIR, copy)
    path = copy / "kvevents.EventBatch.avsc"
    schema = json.loads(path.read_text())
    schema["fields"].insert(len(schema["fields"]) - 1, NOTE)
    path.write_text(json.dumps(schema, indent=2))
    return load_batch_schema(copy)


def test_the_new_field_round_trips(edited_schema: Any) -> None:
    noted = NotedReference(parse_for_codec(edited_schema))
    batch = NotedBatch(**msgspec.structs.asdict(PROBE), note="hello")
    assert noted.decode_body(noted.encode_body(batch)) == batch
    assert noted.decode_body(noted.encode_body(_plain(PROBE))) == NotedBatch(**msgspec.structs.asdict(PROBE))


def test_the_fingerprint_follows_the_avsc_and_the_compiled_codec_notices(edited_schema: Any) -> None:
    parsed = parse_for_codec(edited_schema)
    assert fingerprint_of(parsed) != codec.current_fingerprint()
    if codec._COMPILED is None:
        pytest.fail("kvevents.schemas._fastcodec is not built; run make setup")
    problem = compiled_mismatch(codec._COMPILED, NotedReference(parsed))
    assert problem is not None and "bytes" in problem


@pytest.mark.parametrize("core", ["compiled", "python"])
def test_consumers_apply_new_messages_unchanged(
    edited_schema: Any, core: str, fresh_writers: dict[bytes, object]
) -> None:
    parsed = parse_for_codec(edited_schema)
    fingerprint = register_writer_schema(edited_schema)
    noted = NotedReference(parsed)
    # the probe's events, in an envelope within the consumer's limits
    fields = msgspec.structs.asdict(PROBE)
    fields.update(attention_dp_size=4, producer_id=9, sequence=0, dropped=[], first_event_block_offset=0)
    fields["events"] = [
        msgspec.structs.replace(e, event_id=k, window_size=64, attention_dp_rank=k % 4)
        for k, e in enumerate(PROBE.events)
    ]
    current = EventBatch(**fields)
    new_message = noted.encode_body(NotedBatch(**fields, note="x"), b"\xc3\x01" + fingerprint)
    assert codec.decode_batch(new_message) == current  # resolved to the current schema: note dropped
    new, old = CacheIndex(core=core), CacheIndex(core=core)
    new.apply_encoded(new_message)
    old.apply_encoded(encode_batch(current))
    assert new.to_bytes() == old.to_bytes()
    assert new.stats().counters == old.stats().counters


def test_the_producer_still_splices(edited_schema: Any) -> None:
    noted = NotedReference(parse_for_codec(edited_schema))
    envelope = NotedBatch(**{**msgspec.structs.asdict(PROBE), "events": []}, note="n")
    whole = noted.encode_body(NotedBatch(**msgspec.structs.asdict(PROBE), note="n"))
    template = codec.envelope_of(noted.encode_body(NotedBatch("other", [])))
    events = memoryview(noted.encode_body(NotedBatch("other", PROBE.events)))[len(template) :]
    assert codec.envelope_of(noted.encode_body(envelope)) + events == whole
