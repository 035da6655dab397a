"""The reference Avro body codec: the model <-> fastavro records.

This path is the oracle: the compiled fast path (``_fastcodec``) must write exactly the bytes
``encode_body`` writes and read back exactly what ``decode_body`` reads. It is also the
fallback when the extension is not built, and the only path that resolves a different writer
schema (schema evolution).

fastavro writes whatever integer it is given into an Avro ``int`` (even beyond 32 bits) and
truncates floats, so the record builders check every value first and raise
:class:`EncodeError` naming the field, exactly where the fast path does.
"""

from __future__ import annotations

import io
from array import array
from datetime import UTC, datetime, timedelta
from operator import index
from typing import Any

import fastavro

from .errors import DecodeError, EncodeError
from .model import (
    MM_HASH_SIZE,
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

__all__ = [
    "batch_from_record",
    "batch_to_record",
    "decode_body",
    "encode_body",
    "to_signed64",
    "to_unsigned64",
]

_U64_LIMIT = 1 << 64
_I64_LIMIT = 1 << 63
_I32_LIMIT = 1 << 31
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_MICROSECOND = timedelta(microseconds=1)


def _integer(value: Any, what: str) -> int:
    if value.__class__ is int:
        return value
    try:
        return index(value)
    except TypeError:
        raise EncodeError(f"{what}: expected an integer, got {type(value).__name__}") from None


def _int32(value: Any, what: str) -> int:
    number = _integer(value, what)
    if not -_I32_LIMIT <= number < _I32_LIMIT:
        raise EncodeError(f"{what}: {number} is outside the Avro int range -2^31..2^31-1")
    return number


def _int64(value: Any, what: str) -> int:
    number = _integer(value, what)
    if not -_I64_LIMIT <= number < _I64_LIMIT:
        raise EncodeError(f"{what}: {number} is outside the Avro long range -2^63..2^63-1")
    return number


def to_signed64(value: Any, what: str = "value") -> int:
    """Map an unsigned 64-bit integer to Avro's signed long (two's complement)."""
    number = _integer(value, what)
    if not 0 <= number < _U64_LIMIT:
        raise EncodeError(f"{what}: {number} is outside the unsigned 64-bit range 0..2^64-1")
    return number - _U64_LIMIT if number >= _I64_LIMIT else number


def to_unsigned64(value: int) -> int:
    """Map Avro's signed long back to the unsigned 64-bit integer it stands for."""
    return value + _U64_LIMIT if value < 0 else value


def _optional_signed64(value: Any, what: str) -> int | None:
    return None if value is None else to_signed64(value, what)


def _optional_int32(value: Any, what: str) -> int | None:
    return None if value is None else _int32(value, what)


def _optional_unsigned64(value: int | None) -> int | None:
    return None if value is None else to_unsigned64(value)


def _boolean(value: Any, what: str) -> bool:
    if value is True or value is False:
        return value
    raise EncodeError(f"{what}: expected a bool, got {type(value).__name__}")


def _string(value: Any, what: str) -> str:
    if not isinstance(value, str):
        raise EncodeError(f"{what}: expected a str, got {type(value).__name__}")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise EncodeError(f"{what}: not encodable as UTF-8 ({exc.reason})") from None
    return value


def _sequence(value: Any, what: str) -> list[Any] | tuple[Any, ...] | array[Any]:
    if isinstance(value, (list, tuple, array)):
        return value
    try:
        return list(value)
    except TypeError:
        raise EncodeError(f"{what}: expected a sequence, got {type(value).__name__}") from None


# ---------------------------------------------------------------- model -> record


def _diff_record(diff: Any, what: str) -> dict[str, int] | None:
    if diff is None:
        return None
    if diff.__class__ is not KVCacheEventDiff:
        raise EncodeError(f"{what}: expected a KVCacheEventDiff or None, got {type(diff).__name__}")
    return {
        "old_value": _int32(diff.old_value, f"{what}.old_value"),
        "new_value": _int32(diff.new_value, f"{what}.new_value"),
    }


def _tokens(tokens: Any) -> list[int]:
    if tokens.__class__ is array and tokens.typecode == "i":
        return tokens.tolist()
    return [_int32(t, f"tokens[{i}]") for i, t in enumerate(_sequence(tokens, "tokens"))]


def _extra_ids(block: KVCacheStoredBlockData, n_tokens: int) -> list[int] | None:
    if block.token_extra_ids is None:
        return None
    extra = _sequence(block.token_extra_ids, "token_extra_ids")
    if len(extra) != n_tokens:
        raise EncodeError(f"token_extra_ids: {len(extra)} ids for {n_tokens} tokens (one per token)")
    return [to_signed64(x, f"token_extra_ids[{i}]") for i, x in enumerate(extra)]


def _mm_key_record(key: Any, i: int) -> dict[str, Any]:
    try:
        content_hash, start_offset = key
    except (TypeError, ValueError):
        raise EncodeError(f"mm_keys[{i}]: expected a (hash, start_offset) pair") from None
    if not isinstance(content_hash, bytes) or len(content_hash) != MM_HASH_SIZE:
        raise EncodeError(f"mm_keys[{i}].hash: expected {MM_HASH_SIZE} bytes, got {content_hash!r:.80}")
    return {"hash": content_hash, "start_offset": _int32(start_offset, f"mm_keys[{i}].start_offset")}


def _block_record(block: Any) -> dict[str, Any]:
    if block.__class__ is not KVCacheStoredBlockData:
        raise EncodeError(f"expected a KVCacheStoredBlockData, got {type(block).__name__}")
    salt = block.cache_salt
    return {  # built in wire order, so the first bad field is the one reported, as on the fast path
        "block_hash": to_signed64(block.block_hash, "block_hash"),
        "tokens": (tokens := _tokens(block.tokens)),
        "lora_id": _optional_signed64(block.lora_id, "lora_id"),
        "cache_level": _int32(block.cache_level, "cache_level"),
        "priority": _int32(block.priority, "priority"),
        "token_extra_ids": _extra_ids(block, len(tokens)),
        "mm_keys": [_mm_key_record(k, i) for i, k in enumerate(_sequence(block.mm_keys, "mm_keys"))],
        "cache_salt": None if salt is None else _string(salt, "cache_salt"),
    }


def _blocks(blocks: Any) -> list[dict[str, Any]]:
    records = []
    for j, block in enumerate(_sequence(blocks, "blocks")):
        try:
            records.append(_block_record(block))
        except EncodeError as exc:
            raise exc.within(f"blocks[{j}]") from None
    return records


def _data_record(data: Any) -> tuple[str, dict[str, Any]]:
    cls = data.__class__
    if cls is KVCacheStoredData:
        return "kvevents.KVCacheStoredData", {
            "parent_hash": _optional_signed64(data.parent_hash, "parent_hash"),
            "blocks": _blocks(data.blocks),
        }
    if cls is KVCacheRemovedData:
        hashes = _sequence(data.block_hashes, "block_hashes")
        return "kvevents.KVCacheRemovedData", {
            "block_hashes": [to_signed64(h, f"block_hashes[{i}]") for i, h in enumerate(hashes)]
        }
    if cls is KVCacheUpdatedData:
        return "kvevents.KVCacheUpdatedData", {
            "block_hash": to_signed64(data.block_hash, "block_hash"),
            "cache_level": _diff_record(data.cache_level, "cache_level"),
            "priority": _diff_record(data.priority, "priority"),
        }
    if cls is KVCacheCreatedData:
        levels = _sequence(data.num_blocks_per_cache_level, "num_blocks_per_cache_level")
        return "kvevents.KVCacheCreatedData", {
            "num_blocks_per_cache_level": [
                _int32(n, f"num_blocks_per_cache_level[{i}]") for i, n in enumerate(levels)
            ],
            "snapshot": _boolean(data.snapshot, "snapshot"),
        }
    raise EncodeError(f"unknown event data type {cls.__name__}")


def _data_field(data: Any) -> tuple[str, dict[str, Any]]:
    try:
        return _data_record(data)
    except EncodeError as exc:
        raise exc.within("data") from None


def _event_record(event: Any) -> dict[str, Any]:
    if event.__class__ is not KVCacheEvent:
        raise EncodeError(f"expected a KVCacheEvent, got {type(event).__name__}")
    return {
        "event_id": _int64(event.event_id, "event_id"),
        "data": _data_field(event.data),
        "window_size": _int32(event.window_size, "window_size"),
        "attention_dp_rank": _optional_int32(event.attention_dp_rank, "attention_dp_rank"),
    }


def _drops_record(drops: Any) -> dict[str, int]:
    if drops.__class__ is not RankDrops:
        raise EncodeError(f"expected a RankDrops, got {type(drops).__name__}")
    return {
        "attention_dp_rank": _int32(drops.attention_dp_rank, "attention_dp_rank"),
        "dropped_events": _int64(drops.dropped_events, "dropped_events"),
    }


def _events(events: Any) -> list[dict[str, Any]]:
    records = []
    for i, event in enumerate(_sequence(events, "events")):
        try:
            records.append(_event_record(event))
        except EncodeError as exc:
            raise exc.within(f"events[{i}]") from None
    return records


def _dropped(dropped: Any) -> list[dict[str, int]]:
    records = []
    for i, drops in enumerate(_sequence(dropped, "dropped")):
        try:
            records.append(_drops_record(drops))
        except EncodeError as exc:
            raise exc.within(f"dropped[{i}]") from None
    return records


def batch_to_record(batch: EventBatch) -> dict[str, Any]:
    """The fastavro record of ``batch`` (unsigned hashes mapped to signed longs), checked.

    Raises :class:`EncodeError` naming the field (``events[3].data.blocks[0].block_hash: ...``)
    when a value does not fit its Avro type.
    """
    if batch.__class__ is not EventBatch:
        raise EncodeError(f"expected an EventBatch, got {type(batch).__name__}")
    return {
        "instance_id": _string(batch.instance_id, "instance_id"),
        "attention_dp_size": _int32(batch.attention_dp_size, "attention_dp_size"),
        "producer_id": _int64(batch.producer_id, "producer_id"),
        "sequence": _int64(batch.sequence, "sequence"),
        "created_at": _int64(batch.created_at_us, "created_at_us"),
        "dropped": _dropped(batch.dropped),
        "first_event_block_offset": _int32(batch.first_event_block_offset, "first_event_block_offset"),
        "events": _events(batch.events),
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
        return KVCacheCreatedData(list(record["num_blocks_per_cache_level"]), record["snapshot"])
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
    """The Avro binary body of ``batch`` under ``schema`` (parsed without logical types)."""
    record = batch_to_record(batch)
    out = io.BytesIO()
    try:
        fastavro.schemaless_writer(out, schema, record)
    except (ValueError, TypeError, OverflowError, AttributeError, KeyError) as exc:
        raise EncodeError(f"cannot encode batch of {batch.instance_id!r}: {exc}") from exc
    return out.getvalue()


def read_record(
    body: bytes | bytearray | memoryview, writer_schema: Any, reader_schema: Any | None = None
) -> Any:
    """Read one Avro body into a fastavro record (union branches tagged with record names)."""
    stream = io.BytesIO(body)
    try:
        record = fastavro.schemaless_reader(
            stream,
            writer_schema,
            reader_schema,
            return_record_name=True,
            return_record_name_override=True,
        )
    except (EOFError, StopIteration) as exc:
        raise DecodeError(f"truncated Avro body: {exc or 'unexpected end of data'}") from exc
    except UnicodeDecodeError as exc:
        raise DecodeError(f"invalid UTF-8 in a string field: {exc}") from exc
    except IndexError as exc:
        raise DecodeError(f"invalid union index or enum symbol: {exc}") from exc
    except MemoryError as exc:
        raise DecodeError("a length or count in the body is impossibly large") from exc
    except Exception as exc:
        raise DecodeError(f"malformed Avro body ({type(exc).__name__}: {exc})") from exc
    leftover = len(body) - stream.tell()
    if leftover:
        raise DecodeError(f"{leftover} trailing bytes after the Avro body")
    return record


def decode_body(
    body: bytes | bytearray | memoryview, writer_schema: Any, reader_schema: Any | None = None
) -> EventBatch:
    """Read one ``EventBatch`` body written with ``writer_schema`` (resolved to ``reader_schema``)."""
    record = read_record(body, writer_schema, reader_schema)
    try:
        return batch_from_record(record)
    except DecodeError:
        raise
    except Exception as exc:
        raise DecodeError(f"malformed Avro body ({type(exc).__name__}: {exc})") from exc
