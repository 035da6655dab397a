"""The reference Avro body codec: the model <-> fastavro records.

This path is the oracle: the compiled fast path (``_fastcodec``) must write exactly the bytes
``encode_body`` writes and read back exactly what ``decode_body`` reads. It is also the
fallback when the extension is not built, and the only path that resolves a different writer
schema (schema evolution).
"""

from __future__ import annotations

import io
from array import array
from datetime import datetime, timedelta, timezone
from typing import Any

import fastavro

from .errors import DecodeError, EncodeError
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

__all__ = ["batch_from_record", "batch_to_record", "decode_body", "encode_body", "to_signed64", "to_unsigned64"]

_U64_LIMIT = 1 << 64
_I64_LIMIT = 1 << 63
_EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)
_MICROSECOND = timedelta(microseconds=1)


def to_signed64(value: int, what: str = "value") -> int:
    """Map an unsigned 64-bit integer to Avro's signed long (two's complement)."""
    if not 0 <= value < _U64_LIMIT:
        raise EncodeError(f"{what} {value!r} is outside the unsigned 64-bit range 0..2^64-1")
    return value - _U64_LIMIT if value >= _I64_LIMIT else value


def to_unsigned64(value: int) -> int:
    """Map Avro's signed long back to the unsigned 64-bit integer it stands for."""
    return value + _U64_LIMIT if value < 0 else value


def _optional_signed64(value: int | None, what: str) -> int | None:
    return None if value is None else to_signed64(value, what)


def _optional_unsigned64(value: int | None) -> int | None:
    return None if value is None else to_unsigned64(value)


# ---------------------------------------------------------------- model -> record


def _diff_record(diff: KVCacheEventDiff | None) -> dict[str, int] | None:
    return None if diff is None else {"old_value": diff.old_value, "new_value": diff.new_value}


def _block_record(block: KVCacheStoredBlockData) -> dict[str, Any]:
    extra = block.token_extra_ids
    return {
        "block_hash": to_signed64(block.block_hash, "block_hash"),
        "tokens": block.tokens.tolist(),
        "lora_id": _optional_signed64(block.lora_id, "lora_id"),
        "cache_level": block.cache_level,
        "priority": block.priority,
        "token_extra_ids": None if extra is None else [to_signed64(x, "token_extra_id") for x in extra],
        "mm_keys": [{"hash": h, "start_offset": o} for h, o in block.mm_keys],
        "cache_salt": block.cache_salt,
    }


def _data_record(data: Any) -> tuple[str, dict[str, Any]]:
    cls = data.__class__
    if cls is KVCacheStoredData:
        return "kvevents.KVCacheStoredData", {
            "parent_hash": _optional_signed64(data.parent_hash, "parent_hash"),
            "blocks": [_block_record(b) for b in data.blocks],
        }
    if cls is KVCacheRemovedData:
        return "kvevents.KVCacheRemovedData", {
            "block_hashes": [to_signed64(h, "block_hash") for h in data.block_hashes]
        }
    if cls is KVCacheUpdatedData:
        return "kvevents.KVCacheUpdatedData", {
            "block_hash": to_signed64(data.block_hash, "block_hash"),
            "cache_level": _diff_record(data.cache_level),
            "priority": _diff_record(data.priority),
        }
    if cls is KVCacheCreatedData:
        return "kvevents.KVCacheCreatedData", {
            "num_blocks_per_cache_level": list(data.num_blocks_per_cache_level)
        }
    raise EncodeError(f"unknown event data type {cls.__name__}")


def batch_to_record(batch: EventBatch) -> dict[str, Any]:
    """The fastavro record of ``batch`` (unsigned hashes mapped to signed longs)."""
    return {
        "instance_id": batch.instance_id,
        "attention_dp_size": batch.attention_dp_size,
        "producer_id": batch.producer_id,
        "sequence": batch.sequence,
        "created_at": batch.created_at_us,
        "dropped": [
            {"attention_dp_rank": d.attention_dp_rank, "dropped_events": d.dropped_events}
            for d in batch.dropped
        ],
        "first_event_block_offset": batch.first_event_block_offset,
        "events": [
            {
                "event_id": e.event_id,
                "data": _data_record(e.data),
                "window_size": e.window_size,
                "attention_dp_rank": e.attention_dp_rank,
            }
            for e in batch.events
        ],
    }


# ---------------------------------------------------------------- record -> model


def _diff(record: dict[str, int] | None) -> KVCacheEventDiff | None:
    return None if record is None else KVCacheEventDiff(record["old_value"], record["new_value"])


def _block(record: dict[str, Any]) -> KVCacheStoredBlockData:
    extra = record["token_extra_ids"]
    return KVCacheStoredBlockData(
        block_hash=to_unsigned64(record["block_hash"]),
        tokens=array("i", record["tokens"]),
        lora_id=_optional_unsigned64(record["lora_id"]),
        cache_level=record["cache_level"],
        priority=record["priority"],
        token_extra_ids=None if extra is None else array("Q", [to_unsigned64(x) for x in extra]),
        mm_keys=tuple((m["hash"], m["start_offset"]) for m in record["mm_keys"]),
        cache_salt=record["cache_salt"],
    )


def _data(tagged: tuple[str, dict[str, Any]]) -> Any:
    name, record = tagged
    if name == "kvevents.KVCacheStoredData":
        return KVCacheStoredData(
            parent_hash=_optional_unsigned64(record["parent_hash"]),
            blocks=[_block(b) for b in record["blocks"]],
        )
    if name == "kvevents.KVCacheRemovedData":
        return KVCacheRemovedData([to_unsigned64(h) for h in record["block_hashes"]])
    if name == "kvevents.KVCacheUpdatedData":
        return KVCacheUpdatedData(
            block_hash=to_unsigned64(record["block_hash"]),
            cache_level=_diff(record["cache_level"]),
            priority=_diff(record["priority"]),
        )
    if name == "kvevents.KVCacheCreatedData":
        return KVCacheCreatedData(list(record["num_blocks_per_cache_level"]))
    raise DecodeError(f"unknown event data type {name!r}")


def _micros(value: Any) -> int:
    if isinstance(value, datetime):
        return (value - _EPOCH) // _MICROSECOND
    return int(value)


def batch_from_record(record: dict[str, Any]) -> EventBatch:
    """The model of a fastavro record read with ``return_record_name=True``."""
    return EventBatch(
        instance_id=record["instance_id"],
        events=[
            KVCacheEvent(e["event_id"], _data(e["data"]), e["window_size"], e["attention_dp_rank"])
            for e in record["events"]
        ],
        attention_dp_size=record["attention_dp_size"],
        producer_id=record["producer_id"],
        sequence=record["sequence"],
        created_at_us=_micros(record["created_at"]),
        dropped=[RankDrops(d["attention_dp_rank"], d["dropped_events"]) for d in record["dropped"]],
        first_event_block_offset=record["first_event_block_offset"],
    )


# ---------------------------------------------------------------- bodies


def encode_body(batch: EventBatch, schema: Any) -> bytes:
    """The Avro binary body of ``batch`` under ``schema`` (no framing)."""
    out = io.BytesIO()
    try:
        fastavro.schemaless_writer(out, schema, batch_to_record(batch))
    except EncodeError:
        raise
    except (ValueError, TypeError, OverflowError, AttributeError, KeyError) as exc:
        raise EncodeError(f"cannot encode batch of {batch.instance_id!r}: {exc}") from exc
    return out.getvalue()


def decode_body(body: bytes | memoryview, writer_schema: Any, reader_schema: Any | None = None) -> EventBatch:
    """Read one ``EventBatch`` body written with ``writer_schema`` (resolved to ``reader_schema``)."""
    stream = io.BytesIO(body)
    try:
        record = fastavro.schemaless_reader(
            stream,
            writer_schema,
            reader_schema,
            return_record_name=True,
            return_record_name_override=True,
        )
        leftover = len(body) - stream.tell()
        if leftover:
            raise DecodeError(f"{leftover} trailing bytes after the Avro body")
        return batch_from_record(record)
    except DecodeError:
        raise
    except (EOFError, StopIteration) as exc:
        raise DecodeError(f"truncated Avro body: {exc or 'unexpected end of data'}") from exc
    except UnicodeDecodeError as exc:
        raise DecodeError(f"invalid UTF-8 in a string field: {exc}") from exc
    except IndexError as exc:
        raise DecodeError(f"invalid union index or enum symbol: {exc}") from exc
    except MemoryError as exc:
        raise DecodeError("a length or count in the body is impossibly large") from exc
    except Exception as exc:  # noqa: BLE001 - any failure of the reader means malformed bytes
        raise DecodeError(f"malformed Avro body ({type(exc).__name__}: {exc})") from exc
