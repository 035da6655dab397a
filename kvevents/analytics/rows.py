"""One row per block event: the flat table that ``kvevents export parquet`` writes.

A Stored event gives one row per block, a Removed event one row per hash, an Updated event one
row, a Created event one row (no block), and each in-band loss report of a batch one row of type
``dropped`` (``event_index`` -1). Hashes and LoRA ids are written as Avro writes them (signed 64-bit, two's
complement), so that every tool (pyarrow, DuckDB, Spark) reads the same numbers; see
``docs/ANALYTICS.md`` for turning them back into unsigned values.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

import pyarrow as pa
from kvevents.schemas import (
    EventBatch,
    KVCacheCreatedData,
    KVCacheRemovedData,
    KVCacheStoredData,
    KVCacheUpdatedData,
)

__all__ = ["PARTITION_COLUMNS", "ROW_SCHEMA", "RowBuffer", "date_of", "to_signed"]

_TS = pa.timestamp("us", tz="UTC")
ROW_SCHEMA = pa.schema(
    [
        pa.field("attention_dp_rank", pa.int32()),
        pa.field("window_size", pa.int32()),
        pa.field("event_type", pa.string()),
        pa.field("event_id", pa.int64()),
        pa.field("event_index", pa.int32()),
        pa.field("block_index", pa.int32()),
        pa.field("level_before", pa.int32()),
        pa.field("level_after", pa.int32()),
        pa.field("block_hash", pa.int64()),
        pa.field("parent_hash", pa.int64()),
        pa.field("tokens", pa.int32()),
        pa.field("lora_id", pa.int64()),
        pa.field("dropped_events", pa.int64()),
        pa.field("attention_dp_size", pa.int32()),
        pa.field("producer_id", pa.int64()),
        pa.field("sequence", pa.int64()),
        pa.field("created_at", _TS),
        pa.field("kafka_partition", pa.int32()),
        pa.field("kafka_offset", pa.int64()),
        pa.field("kafka_timestamp", _TS),
    ]
)
"""Columns stored in each Parquet file. ``date`` and ``instance`` are hive partition columns
(directory names), not stored in the files."""
PARTITION_COLUMNS = ("date", "instance")
_NAMES = ROW_SCHEMA.names
_U63 = 1 << 63
_U64 = 1 << 64


def to_signed(value: int | None) -> int | None:
    """An unsigned 64-bit value as Avro's signed ``long`` (two's complement)."""
    if value is None:
        return None
    return value - _U64 if value >= _U63 else value


def date_of(timestamp_us: int) -> str:
    """The UTC date (``YYYY-MM-DD``) of a timestamp in microseconds: the ``date`` partition."""
    return dt.datetime.fromtimestamp(timestamp_us / 1e6, tz=dt.UTC).date().isoformat()


class RowBuffer:
    """Columns of rows, appended message by message, turned into an Arrow table."""

    def __init__(self) -> None:
        self.columns: dict[str, list[Any]] = {name: [] for name in _NAMES}

    def __len__(self) -> int:
        return len(self.columns["event_type"])

    def add_batch(self, batch: EventBatch, partition: int, offset: int, timestamp_us: int) -> int:
        """Append the rows of one decoded batch read at ``partition``/``offset``; returns how many."""
        rows: list[tuple[Any, ...]] = []
        signed = to_signed
        for i, drop in enumerate(batch.dropped):
            drop_rank: int | None = drop.attention_dp_rank
            rows.append((drop_rank, None, "dropped", None, -1, i, None, None, None, None, None, None, drop.dropped_events))  # fmt: skip
        block_offset = batch.first_event_block_offset
        for index, event in enumerate(batch.events):
            rank = event.attention_dp_rank
            window = event.window_size
            eid = event.event_id
            data = event.data
            if isinstance(data, KVCacheStoredData):
                parent = signed(data.parent_hash)
                first = block_offset if index == 0 else 0
                for i, block in enumerate(data.blocks):
                    block_hash = signed(block.block_hash)
                    rows.append(
                        (
                            rank,
                            window,
                            "stored",
                            eid,
                            index,
                            first + i,
                            None,
                            block.cache_level,
                            block_hash,
                            parent,
                            len(block.tokens),
                            signed(block.lora_id),
                            None,
                        )
                    )
                    parent = block_hash
            elif isinstance(data, KVCacheRemovedData):
                for i, block_hash in enumerate(data.block_hashes):
                    rows.append(
                        (
                            rank,
                            window,
                            "removed",
                            eid,
                            index,
                            i,
                            None,
                            None,
                            signed(block_hash),
                            None,
                            None,
                            None,
                            None,
                        )
                    )
            elif isinstance(data, KVCacheUpdatedData):
                level = data.cache_level
                before = None if level is None else level.old_value
                after = None if level is None else level.new_value
                rows.append(
                    (
                        rank,
                        window,
                        "updated",
                        eid,
                        index,
                        None,
                        before,
                        after,
                        signed(data.block_hash),
                        None,
                        None,
                        None,
                        None,
                    )
                )
            elif isinstance(data, KVCacheCreatedData):
                rows.append(
                    (rank, window, "created", eid, index, None, None, None, None, None, None, None, None)
                )
        if not rows:
            return 0
        envelope = (
            batch.attention_dp_size,
            batch.producer_id,
            batch.sequence,
            batch.created_at_us,
            partition,
            offset,
            timestamp_us,
        )
        columns = self.columns
        for name, values in zip(_NAMES[:13], zip(*rows, strict=True), strict=True):
            columns[name].extend(values)
        for name, value in zip(_NAMES[13:], envelope, strict=True):
            columns[name].extend([value] * len(rows))
        return len(rows)

    def table(self) -> pa.Table:
        """The rows as an Arrow table of :data:`ROW_SCHEMA`."""
        return pa.Table.from_pydict(self.columns, schema=ROW_SCHEMA)
