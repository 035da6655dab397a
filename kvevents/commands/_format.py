"""Text and JSON renderings of kvevents batches and events (``tail``), and small formatters."""

from __future__ import annotations

import datetime as dt
from typing import Any

from kvevents.schemas import (
    EventBatch,
    KVCacheCreatedData,
    KVCacheEvent,
    KVCacheRemovedData,
    KVCacheStoredData,
    KVCacheUpdatedData,
)

__all__ = [
    "EVENT_TYPES",
    "batch_json",
    "batch_line",
    "event_json",
    "event_line",
    "event_type",
    "format_hash",
    "format_time_us",
    "json_hash",
    "printable",
]

EVENT_TYPES = ("created", "stored", "removed", "updated")
MAX_HASHES_SHOWN = 4


def event_type(event: KVCacheEvent) -> str:
    """``created``, ``stored``, ``removed`` or ``updated``."""
    data = event.data
    if isinstance(data, KVCacheStoredData):
        return "stored"
    if isinstance(data, KVCacheRemovedData):
        return "removed"
    if isinstance(data, KVCacheUpdatedData):
        return "updated"
    if isinstance(data, KVCacheCreatedData):
        return "created"
    raise TypeError(f"unknown event data {type(data).__name__}")


def format_hash(value: int | None) -> str:
    """A block hash (unsigned 64-bit) as ``0x`` and 16 hex digits, in text and JSON alike
    (JSON numbers above 2**53 lose digits in jq and JavaScript); ``-`` for None."""
    return "-" if value is None else f"0x{value:016x}"


def json_hash(value: int | None) -> str | None:
    """A block hash for JSON output: :func:`format_hash`'s string, None for None."""
    return None if value is None else format_hash(value)


def format_time_us(time_us: int) -> str:
    """UTC ISO time with milliseconds (``-`` for 0: unknown; ``@N us`` for a time past what a
    date can hold, as a producer may write: year 10000 and on)."""
    if time_us <= 0:
        return "-"
    try:
        moment = dt.datetime.fromtimestamp(time_us / 1e6, tz=dt.UTC)
    except (ValueError, OverflowError, OSError):
        return f"@{time_us}us"
    return moment.strftime("%Y-%m-%dT%H:%M:%S.") + f"{moment.microsecond // 1000:03d}Z"


def printable(text: str) -> str:
    """``text`` for a terminal or a log line: as it is when printable, else with its control
    characters escaped as Python does (an instance id is whatever a producer wrote: an ANSI
    escape or a newline in it would rewrite the screen or forge a line)."""
    return text if text.isprintable() else repr(text)[1:-1]


def _hashes(values: list[int]) -> str:
    shown = ",".join(format_hash(h) for h in values[:MAX_HASHES_SHOWN])
    more = len(values) - MAX_HASHES_SHOWN
    return shown + (f",+{more}" if more > 0 else "")


def _summary(event: KVCacheEvent) -> str:
    data = event.data
    if isinstance(data, KVCacheStoredData):
        blocks = data.blocks
        levels = ",".join(str(b.cache_level) for b in blocks[:16]) + ("..." if len(blocks) > 16 else "")
        lora = {b.lora_id for b in blocks if b.lora_id is not None}
        text = (
            f"parent={format_hash(data.parent_hash)} blocks={len(blocks)} "
            f"tokens={sum(len(b.tokens) for b in blocks)} levels={levels} "
            f"hashes={_hashes([b.block_hash for b in blocks])}"
        )
        return text + (f" lora={','.join(map(str, sorted(lora)))}" if lora else "")
    if isinstance(data, KVCacheRemovedData):
        return f"blocks={len(data.block_hashes)} hashes={_hashes(data.block_hashes)}"
    if isinstance(data, KVCacheUpdatedData):
        parts = [f"block={format_hash(data.block_hash)}"]
        if data.cache_level is not None:
            parts.append(f"level {data.cache_level.old_value}->{data.cache_level.new_value}")
        if data.priority is not None:
            parts.append(f"priority {data.priority.old_value}->{data.priority.new_value}")
        return " ".join(parts)
    assert isinstance(data, KVCacheCreatedData)
    levels = ",".join(map(str, data.num_blocks_per_cache_level))
    return f"blocks_per_level={levels}" + (" snapshot" if data.snapshot else "")


def _rank(event: KVCacheEvent) -> int:
    return 0 if event.attention_dp_rank is None else event.attention_dp_rank


def event_line(batch: EventBatch, event: KVCacheEvent, time_us: int) -> str:
    """``TIME INSTANCE rRANK #EVENT_ID TYPE w=WINDOW SUMMARY``."""
    return (
        f"{format_time_us(time_us)} {printable(batch.instance_id)} r{_rank(event)} #{event.event_id} "
        f"{event_type(event)} w={event.window_size} {_summary(event)}"
    )


def batch_line(batch: EventBatch, partition: int, offset: int, time_us: int, note: str = "") -> str:
    """The batch's envelope: sequence, producer, events, in-band drops (and ``note``)."""
    drops = " ".join(f"r{d.attention_dp_rank}:{d.dropped_events}" for d in batch.dropped if d.dropped_events)
    text = (
        f"{format_time_us(time_us)} {printable(batch.instance_id)} batch seq={batch.sequence} "
        f"producer={batch.producer_id} events={len(batch.events)} dp={batch.attention_dp_size} "
        f"at p{partition}@{offset}"
    )
    if batch.first_event_block_offset:
        text += f" continues_at_block={batch.first_event_block_offset}"
    if drops:
        text += f" DROPPED {drops}"
    return "-- " + text + (f" {note}" if note else "")


def _data_json(event: KVCacheEvent) -> dict[str, Any]:
    data = event.data
    if isinstance(data, KVCacheStoredData):
        return {
            "parent_hash": json_hash(data.parent_hash),
            "blocks": [
                {
                    "block_hash": json_hash(b.block_hash),
                    "tokens": len(b.tokens),
                    "cache_level": b.cache_level,
                    "priority": b.priority,
                    "lora_id": b.lora_id,
                }
                for b in data.blocks
            ],
        }
    if isinstance(data, KVCacheRemovedData):
        return {"block_hashes": [json_hash(h) for h in data.block_hashes]}
    if isinstance(data, KVCacheUpdatedData):
        return {
            "block_hash": json_hash(data.block_hash),
            "cache_level": None
            if data.cache_level is None
            else [data.cache_level.old_value, data.cache_level.new_value],
            "priority": None if data.priority is None else [data.priority.old_value, data.priority.new_value],
        }
    assert isinstance(data, KVCacheCreatedData)
    return {"num_blocks_per_cache_level": list(data.num_blocks_per_cache_level), "snapshot": data.snapshot}


def event_json(
    batch: EventBatch, event: KVCacheEvent, time_us: int, partition: int, offset: int
) -> dict[str, Any]:
    """One event as a JSON-ready dict (hashes as :func:`format_hash` strings; tokens as counts)."""
    return {
        "kind": "event",
        "time_us": time_us,
        "instance_id": batch.instance_id,
        "attention_dp_rank": _rank(event),
        "event_id": event.event_id,
        "type": event_type(event),
        "window_size": event.window_size,
        "data": _data_json(event),
        "batch_sequence": batch.sequence,
        "partition": partition,
        "offset": offset,
    }


def batch_json(
    batch: EventBatch, partition: int, offset: int, time_us: int, note: str = ""
) -> dict[str, Any]:
    """A batch's envelope as a JSON-ready dict."""
    return {
        "kind": "batch",
        "time_us": time_us,
        "instance_id": batch.instance_id,
        "sequence": batch.sequence,
        "producer_id": batch.producer_id,
        "attention_dp_size": batch.attention_dp_size,
        "events": len(batch.events),
        "dropped": {str(d.attention_dp_rank): d.dropped_events for d in batch.dropped if d.dropped_events},
        "first_event_block_offset": batch.first_event_block_offset,
        "partition": partition,
        "offset": offset,
        "note": note or None,
    }
