"""The import-time check that the compiled codec implements the ``.avsc`` files.

The compiled codec (``_fastcodec``) is written by hand for one schema. Rather than trusting a
fingerprint copied into it, ``codec`` encodes a probe batch that sets every field with both the
compiled codec and fastavro (the reference, which reads the ``.avsc``), and compares the bytes,
the decoded batches, and what the flat reader of the index core reads.
"""

from __future__ import annotations

from array import array
from typing import Any

from .model import (
    EventBatch,
    KVCacheCreatedData,
    KVCacheEvent,
    KVCacheEventDiff,
    KVCacheRemovedData,
    KVCacheStoredBlockData,
    KVCacheStoredData,
    KVCacheUpdatedData,
    RankDrops,
)

__all__ = ["PROBE", "compiled_mismatch", "flat_summary", "without_field"]

_FULL_BLOCK = KVCacheStoredBlockData(
    2**64 - 1,
    array("i", [0, -1, 2**31 - 1, -(2**31), 70_000]),
    lora_id=2**63 + 5,
    cache_level=1,
    priority=-3,
    token_extra_ids=array("Q", [0, 2**64 - 1, 1, 0, 9]),
    mm_keys=((bytes(range(32)), -7), (b"\xff" * 32, 2**31 - 1)),
    cache_salt="sel-\u00e9\U0001f600",
)
PROBE = EventBatch(
    "instance-\u00e9",
    [
        KVCacheEvent(0, KVCacheCreatedData([64, 0, 2**31 - 1], snapshot=True), 32, 0),
        KVCacheEvent(
            1, KVCacheStoredData(2**64 - 2, [_FULL_BLOCK, KVCacheStoredBlockData(3, array("i"))]), 32, 1
        ),
        KVCacheEvent(2, KVCacheStoredData(None, []), -1, None),
        KVCacheEvent(2**63 - 1, KVCacheRemovedData([0, 2**64 - 1, 12345]), 16, 2**31 - 1),
        KVCacheEvent(
            -5, KVCacheUpdatedData(7, KVCacheEventDiff(0, 1), KVCacheEventDiff(-(2**31), 2**31 - 1)), 8
        ),
        KVCacheEvent(6, KVCacheUpdatedData(2**64 - 1), 0, -4),
        KVCacheEvent(7, KVCacheCreatedData([]), 0),
    ],
    attention_dp_size=2**31 - 1,
    producer_id=-(2**63),
    sequence=2**63 - 1,
    created_at_us=-1,
    dropped=[RankDrops(0, 2**63 - 1), RankDrops(-1, -2)],
    first_event_block_offset=2**31 - 1,
)
"""A batch that sets every field of the schema, with extreme values."""


def flat_summary(batch: EventBatch) -> tuple[Any, ...]:
    """What ``_fastcodec.flat_check`` must read from the body of ``batch`` (same layout)."""
    events = []
    for event in batch.events:
        data = event.data
        if isinstance(data, KVCacheStoredData):
            blocks = [
                (
                    b.block_hash,
                    list(b.tokens),
                    b.lora_id,
                    b.cache_level,
                    b.priority,
                    None if b.token_extra_ids is None else list(b.token_extra_ids),
                    list(b.mm_keys),
                    b.cache_salt,
                )
                for b in data.blocks
            ]
            summary: Any = (data.parent_hash, blocks)
            kind = 1
        elif isinstance(data, KVCacheUpdatedData):
            level = None if data.cache_level is None else data.cache_level.new_value
            priority = None if data.priority is None else data.priority.new_value
            summary, kind = (data.block_hash, level, priority), 3
        elif isinstance(data, KVCacheRemovedData):
            summary, kind = list(data.block_hashes), 2
        else:
            summary, kind = (list(data.num_blocks_per_cache_level), data.snapshot), 0
        events.append((event.event_id, kind, event.window_size, event.attention_dp_rank, summary))
    return (
        batch.instance_id,
        batch.attention_dp_size,
        batch.producer_id,
        batch.sequence,
        batch.created_at_us,
        [(d.attention_dp_rank, d.dropped_events) for d in batch.dropped],
        batch.first_event_block_offset,
        events,
    )


def compiled_mismatch(compiled: Any, reference: Any, probe: EventBatch = PROBE) -> str | None:
    """None when ``compiled`` writes and reads ``probe`` exactly as ``reference`` does; else
    what differs."""
    try:
        expected = reference.encode_body(probe)
        written = compiled.encode_body(probe)
        if written != expected:
            return f"it writes {len(written)} bytes where the schema gives {len(expected)}, or other bytes"
        if reference.decode_body(expected) != probe:
            return "the reference does not read the probe back (the model and schema disagree)"
        if compiled.decode_body(expected) != probe:
            return "it reads the schema's bytes back as another batch"
        if compiled.flat_check(expected) != flat_summary(probe):
            return "its flat reader reads the schema's bytes differently"
    except Exception as exc:  # noqa: BLE001 - any failure means the compiled codec is unusable
        return f"{type(exc).__name__}: {exc}"
    return None


def without_field(schema: Any, record: str, field: str) -> Any:
    """A copy of a schema's JSON with ``field`` removed from the record named ``record``."""
    if isinstance(schema, list):
        return [without_field(item, record, field) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {key: without_field(value, record, field) for key, value in schema.items()}
    if out.get("type") == "record" and str(out.get("name", "")).rsplit(".", 1)[-1] == record:
        out["fields"] = [f for f in out["fields"] if f.get("name") != field]
    return out
