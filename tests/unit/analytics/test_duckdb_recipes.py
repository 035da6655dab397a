"""Every ```sql block of docs/ANALYTICS.md runs, in order, in DuckDB over a real export
directory written by the exporter's sink; the answers that are known are checked."""

from __future__ import annotations

import re
from pathlib import Path

import duckdb
import pytest
from kvevents.schemas import (
    EventBatch,
    KVCacheCreatedData,
    KVCacheEvent,
    KVCacheRemovedData,
    KVCacheStoredBlockData,
    KVCacheStoredData,
    RankDrops,
)

from kvevents.analytics.parquet_sink import ParquetSink
from kvevents.analytics.report import CacheReport
from kvevents.analytics.rows import RowBuffer
from kvevents.analytics.source import Read

DOC = Path(__file__).resolve().parents[3] / "docs" / "ANALYTICS.md"
BIG = (1 << 64) - 3
T0 = 1_796_000_000_000_000


def _recipes() -> list[str]:
    return re.findall(r"```sql\n(.*?)```", DOC.read_text(), flags=re.S)


def _stream() -> list[Read]:
    def stored(eid: int, parent: int | None, hashes: list[int], rank: int) -> KVCacheEvent:
        return KVCacheEvent(
            eid, KVCacheStoredData(parent, [KVCacheStoredBlockData(h, [1] * 16) for h in hashes]), 64, rank
        )

    batches = [
        EventBatch(
            "a", [KVCacheEvent(0, KVCacheCreatedData([8]), 64, 0), stored(1, None, [BIG, 2], 0)], 2, 1, 0
        ),
        EventBatch(
            "b", [KVCacheEvent(0, KVCacheCreatedData([8]), 64, 0), stored(1, None, [BIG, 5], 0)], 1, 9, 0
        ),
        EventBatch(
            "a", [KVCacheEvent(2, KVCacheRemovedData([2]), 64, 0)], 2, 1, 1, dropped=[RankDrops(1, 6)]
        ),
        EventBatch(
            "a", [KVCacheEvent(3, KVCacheRemovedData([BIG]), 64, 0)], 2, 1, 4
        ),  # batches 2 and 3 missing
        EventBatch("b", [KVCacheEvent(2, KVCacheRemovedData([5]), 64, 0)], 1, 9, 1),
    ]
    return [
        Read(
            EventBatch(
                b.instance_id,
                b.events,
                b.attention_dp_size,
                b.producer_id,
                b.sequence,
                T0 + i * 2_000_000,
                b.dropped,
            ),
            T0 + i * 2_000_000,
            0,
            i,
        )
        for i, b in enumerate(batches)
    ]


@pytest.fixture
def export(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> list[Read]:
    reads = _stream()
    tables = {}
    for r in reads:
        buffer = RowBuffer()
        buffer.add_batch(r.batch, r.partition, r.offset, r.time_us)
        tables[("2026-12-01", r.batch.instance_id, r.offset)] = buffer.table()
    sink = ParquetSink(tmp_path / "events", "t")
    for (date, instance, offset), table in tables.items():
        sink.write_chunk({(date, instance): table}, {0: offset + 1}, messages=1, malformed=[])
    monkeypatch.chdir(tmp_path)
    return reads


def test_every_documented_query_runs(export: list[Read]) -> None:
    recipes = _recipes()
    assert len(recipes) >= 8
    db = duckdb.connect()
    results = [
        db.sql(sql).fetchall() if not sql.lstrip().upper().startswith("CREATE") else db.execute(sql)
        for sql in recipes
    ]
    counts = dict(((i, t), n) for i, t, n in results[1])
    assert counts == {("a", "created"): 1, ("a", "stored"): 2, ("a", "removed"): 2, ("a", "dropped"): 1,
                      ("b", "created"): 1, ("b", "stored"): 2, ("b", "removed"): 1}  # fmt: skip
    report = CacheReport().add_all(export).to_json()
    blocks, p50, _p99 = results[3][0]
    assert blocks == report["block_lifetimes"]["count"] == 3
    assert p50 == pytest.approx(report["block_lifetimes"]["p50_s"])
    assert results[4] == [(3, 1)]  # BIG stored by a/0 and b/0
    assert results[6] == [("a", 1, 6)]
    assert results[7] == [("a", 2)] and report["loss"]["missing_batches"] == 2
    assert {(h, engine) for h, engine, _hex in results[8]} >= {(-3, BIG)}
