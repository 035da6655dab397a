"""Rows of one batch (every event type, unsigned hashes, split Stored events, in-band drops)
and the export directory's chunk/state protocol (leftovers of a killed run, topic mismatch)."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from kvevents.schemas import (
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

from kvevents.analytics.parquet_sink import STATE_FILE, ExportState, ParquetSink, partition_dir
from kvevents.analytics.rows import ROW_SCHEMA, RowBuffer, date_of, to_signed

BIG = (1 << 64) - 5  # an unsigned hash above 2**63: written as -5


def _batch(first_offset: int = 0) -> EventBatch:
    blocks = [
        KVCacheStoredBlockData(BIG, [1, 2, 3, 4], lora_id=9),
        KVCacheStoredBlockData(11, [5, 6], cache_level=1),
    ]
    return EventBatch(
        "engine/0",
        [
            KVCacheEvent(4, KVCacheStoredData(7, blocks), 8192, attention_dp_rank=1),
            KVCacheEvent(5, KVCacheRemovedData([11, BIG]), 8192, attention_dp_rank=1),
            KVCacheEvent(6, KVCacheUpdatedData(BIG, cache_level=KVCacheEventDiff(0, 1)), 8192, 1),
            KVCacheEvent(0, KVCacheCreatedData([64, 16]), 8192, attention_dp_rank=0),
        ],
        attention_dp_size=2,
        producer_id=3,
        sequence=12,
        created_at_us=1_796_000_000_000_000,
        dropped=[RankDrops(0, 17)],
        first_event_block_offset=first_offset,
    )


def test_signed_and_date() -> None:
    assert to_signed(BIG) == -5
    assert to_signed((1 << 63) - 1) == (1 << 63) - 1
    assert to_signed(None) is None
    assert date_of(0) == "1970-01-01"
    assert date_of(86_400 * 1_000_000 - 1) == "1970-01-01"


def test_one_row_per_block_event() -> None:
    buffer = RowBuffer()
    assert buffer.add_batch(_batch(), partition=2, offset=40, timestamp_us=1_796_000_000_123_000) == 7
    table = buffer.table()
    assert table.schema == ROW_SCHEMA
    rows = table.to_pylist()
    kinds = [
        (r["event_type"], r["block_hash"], r["parent_hash"], r["level_before"], r["level_after"])
        for r in rows
    ]
    assert kinds == [
        ("dropped", None, None, None, None),
        ("stored", -5, 7, None, 0),
        ("stored", 11, -5, None, 1),  # block i's parent is block i-1
        ("removed", 11, None, None, None),
        ("removed", -5, None, None, None),
        ("updated", -5, None, 0, 1),
        ("created", None, None, None, None),
    ]
    assert rows[0]["dropped_events"] == 17 and rows[0]["attention_dp_rank"] == 0
    assert [r["tokens"] for r in rows[1:3]] == [4, 2]
    assert [r["lora_id"] for r in rows[1:3]] == [9, None]
    assert [r["block_index"] for r in rows[1:5]] == [0, 1, 0, 1]
    assert [r["event_index"] for r in rows] == [-1, 0, 0, 1, 1, 2, 3]
    assert {r["attention_dp_size"] for r in rows} == {2}
    assert {r["kafka_partition"] for r in rows} == {2} and {r["kafka_offset"] for r in rows} == {40}
    assert {r["sequence"] for r in rows} == {12} and {r["producer_id"] for r in rows} == {3}
    assert rows[0]["created_at"].timestamp() == 1_796_000_000.0
    assert rows[0]["kafka_timestamp"].timestamp() == pytest.approx(1_796_000_000.123)


def test_split_stored_event_keeps_block_positions() -> None:
    buffer = RowBuffer()
    buffer.add_batch(_batch(first_offset=30), 0, 0, 0)
    stored = [r for r in buffer.table().to_pylist() if r["event_type"] == "stored"]
    assert [r["block_index"] for r in stored] == [30, 31]


def _tables(instance: str = "engine/0") -> dict[tuple[str, str], object]:
    buffer = RowBuffer()
    buffer.add_batch(_batch(), 0, 0, 0)
    return {("1970-01-01", instance): buffer.table()}


def test_chunks_state_and_leftovers(tmp_path: Path) -> None:
    sink = ParquetSink(tmp_path, "events")
    assert sink.write_chunk(_tables(), {0: 1}, messages=1, malformed=[]) == 7  # type: ignore[arg-type]
    directory = partition_dir(tmp_path, "1970-01-01", "engine/0")
    assert directory.name == "instance=engine%2F0"
    written = directory / "part-00000000.parquet"
    assert pq.read_table(written).num_rows == 7
    state = json.loads((tmp_path / STATE_FILE).read_text())
    assert state["offsets"] == {"0": 1} and state["next_chunk"] == 1 and state["rows"] == 7

    # A run killed after renaming chunk 1's files but before saving the state, and one killed
    # while writing: both are removed by the next run, chunk 0 stays.
    (directory / "part-00000001.parquet").write_bytes(written.read_bytes())
    (directory / ".part-00000002.parquet.tmp").write_bytes(b"partial")
    again = ParquetSink(tmp_path, "events")
    assert again.removed_leftovers == 2
    assert sorted(p.name for p in directory.iterdir()) == ["part-00000000.parquet"]
    assert again.state.offsets == {0: 1}


def test_malformed_are_listed(tmp_path: Path) -> None:
    sink = ParquetSink(tmp_path, "events")
    sink.write_chunk({}, {0: 5}, messages=5, malformed=[{"partition": 0, "offset": 3, "error": "bad"}])
    assert json.loads((tmp_path / "_malformed.jsonl").read_text()) == {
        "partition": 0,
        "offset": 3,
        "error": "bad",
    }
    assert ExportState.load(tmp_path, "events").malformed == 1


def test_another_topic_or_a_broken_state_is_refused(tmp_path: Path) -> None:
    ParquetSink(tmp_path, "events").write_chunk(_tables(), {0: 1}, messages=1, malformed=[])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="holds an export of topic 'events', not 'other'"):
        ParquetSink(tmp_path, "other")
    (tmp_path / STATE_FILE).write_text("{not json")
    with pytest.raises(ValueError, match="not a kvevents export state file"):
        ParquetSink(tmp_path, "events")


def test_an_instance_folder_name_past_255_bytes_is_refused_by_name() -> None:
    from kvevents.analytics.parquet_sink import PartitionNameError, check_instance_folder

    check_instance_folder("x" * 246)  # "instance=" + 246: 255 bytes
    for too_long in ("x" * 247, "/" * 86, "\u00e9" * 128):
        with pytest.raises(PartitionNameError, match="partition folder name, over the 255 bytes"):
            check_instance_folder(too_long)
