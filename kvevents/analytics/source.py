"""Where a report reads from: a Parquet export directory or the topic itself, both as the same
stream of :class:`Read` items (a batch, its time and where Kafka had it), in Kafka's order.

From Parquet the batches are rebuilt from the rows (:func:`batches_from_table`): every event,
hash, parent, level, LoRA id, id and loss report comes back; token ids do not (a row keeps only
their count, so a rebuilt block has that many zero tokens) and a Created event comes back with
an empty capacity.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.dataset as ds
from kvevents.schemas import (
    EventBatch,
    KVCacheCreatedData,
    KVCacheEvent,
    KVCacheEventData,
    KVCacheEventDiff,
    KVCacheRemovedData,
    KVCacheStoredBlockData,
    KVCacheStoredData,
    KVCacheUpdatedData,
    RankDrops,
)

__all__ = ["Read", "batches_from_table", "read_parquet_dir", "read_topic"]

_U64 = 1 << 64
_ORDER = [
    ("kafka_timestamp", "ascending"),
    ("kafka_partition", "ascending"),
    ("kafka_offset", "ascending"),
    ("event_index", "ascending"),
    ("block_index", "ascending"),
]


@dataclass(frozen=True, slots=True)
class Read:
    """One batch and where it came from; ``time_us`` is its creation time (else Kafka's)."""

    batch: EventBatch
    time_us: int
    partition: int
    offset: int


def read_parquet_dir(path: Path) -> pa.Table:
    """Every row of an export directory (hive partitions ``date`` and ``instance`` as strings)."""
    if not path.is_dir():
        raise ValueError(f"{path}: not a directory")
    partitioning = ds.partitioning(
        pa.schema([("date", pa.string()), ("instance", pa.string())]), flavor="hive"
    )
    dataset = ds.dataset(path, format="parquet", partitioning=partitioning)
    if not dataset.files:
        raise ValueError(f"{path}: no Parquet files (is it a 'kvevents export parquet' directory?)")
    return dataset.to_table()


def _unsigned(value: int | None) -> int | None:
    return None if value is None else value % _U64


def batches_from_table(table: pa.Table) -> Iterator[Read]:
    """The batches the rows were made from, in Kafka order (timestamp, partition, offset)."""
    table = table.sort_by(_ORDER)
    columns = {name: table.column(name).to_pylist() for name in table.column_names if name != "date"}
    columns["kafka_timestamp"] = table.column("kafka_timestamp").cast(pa.int64()).to_pylist()
    columns["created_at"] = table.column("created_at").cast(pa.int64()).to_pylist()
    n = table.num_rows
    start = 0
    partition_col, offset_col = columns["kafka_partition"], columns["kafka_offset"]
    while start < n:
        end = start + 1
        while end < n and offset_col[end] == offset_col[start] and partition_col[end] == partition_col[start]:
            end += 1
        yield _batch(columns, start, end)
        start = end


def _batch(c: Mapping[str, list[Any]], start: int, end: int) -> Read:
    dropped: list[RankDrops] = []
    events: list[KVCacheEvent] = []
    first_offset = 0
    i = start
    while i < end:
        kind = c["event_type"][i]
        if kind == "dropped":
            dropped.append(RankDrops(c["attention_dp_rank"][i], c["dropped_events"][i]))
            i += 1
            continue
        j = i + 1
        while j < end and c["event_index"][j] == c["event_index"][i]:
            j += 1
        data: KVCacheEventData
        if kind == "stored":
            if c["event_index"][i] == 0 and c["block_index"][i]:
                first_offset = c["block_index"][i]
            blocks = [
                KVCacheStoredBlockData(
                    _unsigned(c["block_hash"][k]),  # type: ignore[arg-type]
                    array("i", bytes(4 * c["tokens"][k])),
                    lora_id=_unsigned(c["lora_id"][k]),
                    cache_level=c["level_after"][k],
                )
                for k in range(i, j)
            ]
            data = KVCacheStoredData(_unsigned(c["parent_hash"][i]), blocks)
        elif kind == "removed":
            data = KVCacheRemovedData([_unsigned(c["block_hash"][k]) for k in range(i, j)])  # type: ignore[misc]
        elif kind == "updated":
            before, after = c["level_before"][i], c["level_after"][i]
            diff = None if before is None or after is None else KVCacheEventDiff(before, after)
            data = KVCacheUpdatedData(_unsigned(c["block_hash"][i]), cache_level=diff)  # type: ignore[arg-type]
        elif kind == "created":
            data = KVCacheCreatedData([])
        else:
            raise ValueError(f"unknown event_type {kind!r} at offset {c['kafka_offset'][i]}")
        events.append(KVCacheEvent(c["event_id"][i], data, c["window_size"][i], c["attention_dp_rank"][i]))
        i = j
    batch = EventBatch(
        c["instance"][start],
        events,
        attention_dp_size=c["attention_dp_size"][start],
        producer_id=c["producer_id"][start],
        sequence=c["sequence"][start],
        created_at_us=c["created_at"][start],
        dropped=dropped,
        first_event_block_offset=first_offset,
    )
    created = c["created_at"][start]
    time_us = created if created > 0 else c["kafka_timestamp"][start]
    return Read(batch, time_us, c["kafka_partition"][start], c["kafka_offset"][start])


def read_topic(
    bootstrap_servers: str,
    topic: str,
    *,
    config: Mapping[str, Any] | None = None,
    on_malformed: Callable[[int, int, str], None] | None = None,
    codec: Any = None,
) -> Iterator[Read]:
    """The topic from the beginning until caught up, decoded with ``codec`` (default: single-object
    framing; a ``RegistryCodec`` reads both framings); malformed messages go to
    ``on_malformed(partition, offset, error)`` and are skipped."""
    from kvevents.consumer import EventReader
    from kvevents.schemas import DecodeError

    with EventReader(bootstrap_servers, topic, config=config, codec=codec) as reader:
        for message in reader.messages(until_caught_up=True):
            try:
                batch = reader.decode(message.value())
            except DecodeError as exc:
                if on_malformed is not None:
                    on_malformed(message.partition(), message.offset(), str(exc))
                continue
            created = batch.created_at_us
            time_us = created if created > 0 else message.timestamp()[1] * 1000
            yield Read(batch, time_us, message.partition(), message.offset())
