"""The Spark job in local mode against the real broker (``make test-spark``; deselected by the
default run): on a simulated topic with in-band drops, a sequence gap and a malformed message,
Spark writes exactly the rows ``kvevents export parquet`` writes (same layout, same schema),
its aggregates agree with the report, and a second run after more events adds only those."""

from __future__ import annotations

import contextlib
import io
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.dataset as ds
import pytest
from cli_streams import simulate_to_topic
from kafka_streams import produce
from kvevents.schemas import EventBatch, KVCacheEvent, KVCacheRemovedData, RankDrops

from kvevents.analytics.report import CacheReport
from kvevents.analytics.rows import ROW_SCHEMA
from kvevents.analytics.source import batches_from_table, read_parquet_dir
from kvevents.analytics.spark_jars import ensure_spark_jars
from kvevents.analytics.spark_job import run_spark_export, spark_session
from kvevents.cli import main

pytestmark = [pytest.mark.spark, pytest.mark.slow, pytest.mark.kafka, pytest.mark.timeout(900)]

_ORDER = ["kafka_partition", "kafka_offset", "event_index", "block_index"]


@pytest.fixture(scope="module")
def spark() -> Iterator[Any]:
    session = spark_session(ensure_spark_jars())
    yield session
    session.stop()


def _sorted_rows(path: Path) -> list[dict[str, Any]]:
    table = read_parquet_dir(path)
    return (
        table.sort_by([(c, "ascending") for c in _ORDER])
        .select([*ROW_SCHEMA.names, "date", "instance"])
        .to_pylist()
    )


def _export(bootstrap: str, topic: str, out: Path) -> None:
    assert main(["export", "parquet", str(out), "-b", bootstrap, "-t", topic, "-q"]) == 0


def _extras(bootstrap: str, topic: str) -> None:
    """sim-x: in-band drops of two ranks, then batches 1 and 2 missing; and two malformed messages."""
    t = 1_796_000_000_000_000
    lossy = EventBatch(
        "sim-x", [KVCacheEvent(9, KVCacheRemovedData([(1 << 64) - 1, 3]), 32, 1)], 2, 5, 0,
        created_at_us=t, dropped=[RankDrops(0, 11), RankDrops(1, 2)],
    )  # fmt: skip
    later = EventBatch(
        "sim-x", [KVCacheEvent(12, KVCacheRemovedData([4]), 32, 1)], 2, 5, 3, created_at_us=t + 1
    )
    produce(
        bootstrap,
        topic,
        [lossy, later, (b"sim-x", b"\xc3\x01garbage-after-a-header"), (b"k", b"not a batch")],
    )


def test_spark_writes_what_export_parquet_writes(
    spark: Any, kafka_bootstrap: str, kafka_topic_factory: Any, tmp_path: Path
) -> None:
    topic = kafka_topic_factory(partitions=2)
    simulate_to_topic(kafka_bootstrap, topic, iterations=25)
    _extras(kafka_bootstrap, topic)
    spark_dir, export_dir = tmp_path / "spark", tmp_path / "export"

    first = run_spark_export(spark, kafka_bootstrap, topic, spark_dir)
    _export(kafka_bootstrap, topic, export_dir)
    spark_rows = _sorted_rows(spark_dir)
    assert spark_rows == _sorted_rows(export_dir) and len(spark_rows) > 300

    files = ds.dataset(spark_dir, format="parquet", partitioning="hive").files
    schema = pa.unify_schemas([ds.dataset(f, format="parquet").schema for f in files[:1]])
    assert [(f.name, f.type) for f in schema] == [(f.name, f.type) for f in ROW_SCHEMA]
    assert {Path(f).parent.name for f in files} == {"instance=sim-a", "instance=sim-b", "instance=sim-x"}
    malformed = [
        json.loads(line)
        for f in (spark_dir / "_spark_malformed").glob("*.json")
        for line in f.read_text().splitlines()
    ]
    assert len(malformed) == 2

    report = CacheReport().add_all(batches_from_table(read_parquet_dir(export_dir))).to_json()
    agg = first["aggregates"]
    assert agg["rows_by_type"]["stored"] == report["prefix_reuse"]["stored_blocks"]
    assert agg["events_by_type"] == {k: v for k, v in report["events"].items() if v}
    assert sum(agg["dropped_by_worker"].values()) == report["loss"]["dropped_events"] == 13
    assert agg["missing_batches_by_instance"] == {"sim-x": 2}
    assert report["loss"]["missing_batches"] == 2

    simulate_to_topic(kafka_bootstrap, topic, instances=("sim-c",), ranks=1, iterations=10)
    run_spark_export(spark, kafka_bootstrap, topic, spark_dir)  # resumes from its checkpoint
    _export(kafka_bootstrap, topic, export_dir)
    again = _sorted_rows(spark_dir)
    assert again == _sorted_rows(export_dir) and len(again) > len(spark_rows)

    def report_json(directory: Path) -> dict[str, Any]:
        buffer = io.StringIO()
        with contextlib.redirect_stdout(buffer):
            assert main(["report", "--parquet", str(directory), "--json", "-q"]) == 0
        report = json.loads(buffer.getvalue())
        report.pop("source")
        return report

    from_spark = report_json(spark_dir)
    assert from_spark == report_json(export_dir) and from_spark["loss"]["malformed_messages"] == 2
