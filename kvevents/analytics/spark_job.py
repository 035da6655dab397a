"""The Spark Structured Streaming job: the topic into the same Parquet layout as
``kvevents export parquet``, at Spark's scale.

Spark's Kafka source reads the topic; ``from_avro`` (spark-avro) decodes the body after the
10-byte single-object header (``substring(value, 11, ...)``: SQL substrings are 1-based) with
the full ``EventBatch`` schema; SQL turns each batch into one row per block event (the columns
of :data:`kvevents.analytics.rows.ROW_SCHEMA`), and a file sink writes them partitioned by
``date`` and ``instance`` with exactly-once bookkeeping in ``DIR/_spark_metadata`` and the
Kafka offsets in ``DIR/_spark_checkpoint`` (a re-run resumes). Messages that do not decode go
to ``DIR/_spark_malformed`` (JSON: partition, offset), and so do batches written with another
schema version than this package's (``from_avro`` has one reader schema; ``kvevents export
parquet`` reads the shipped older versions too). At the end the job computes the report's
counting aggregates over what it wrote (``DIR/_spark_aggregates.json``).

Run by ``kvevents export spark DIR`` (or ``python -m kvevents.analytics.spark_job``); needs the
``spark`` extra and the jars of :mod:`kvevents.analytics.spark_jars`.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = ["ROWS_SQL", "SparkExportResult", "run_spark_export", "spark_session"]


_ROW_FIELDS = (
    ("attention_dp_rank", "INT"), ("window_size", "INT"), ("event_type", "STRING"), ("event_id", "BIGINT"),
    ("event_index", "INT"), ("block_index", "INT"), ("level_before", "INT"), ("level_after", "INT"),
    ("block_hash", "BIGINT"), ("parent_hash", "BIGINT"), ("tokens", "INT"), ("lora_id", "BIGINT"),
    ("dropped_events", "BIGINT"),
)  # fmt: skip


def _row(**values: str) -> str:
    """``named_struct`` of every row field (typed NULL for those not given), so that all kinds
    of rows have one struct type."""
    parts = []
    for name, sql_type in _ROW_FIELDS:
        parts.append(f"'{name}', CAST({values.get(name, 'NULL')} AS {sql_type})")
    return "named_struct(" + ", ".join(parts) + ")"


_EVENT = {
    "attention_dp_rank": "e.attention_dp_rank",
    "window_size": "e.window_size",
    "event_id": "e.event_id",
    "event_index": "ei",
}
_STORED = "e.data.member1"
ROWS_SQL = f"""
SELECT r.*, b.attention_dp_size AS attention_dp_size, b.producer_id AS producer_id, b.sequence AS sequence,
       b.created_at AS created_at, kafka_partition, kafka_offset, kafka_timestamp,
       date_format(kafka_timestamp, 'yyyy-MM-dd') AS date, b.instance_id AS instance
FROM decoded LATERAL VIEW inline(concat(
  transform(b.dropped, (dr, di) -> {
    _row(
        attention_dp_rank="dr.attention_dp_rank",
        event_type="'dropped'",
        event_index="-1",
        block_index="di",
        dropped_events="dr.dropped_events",
    )
}),
  flatten(transform(b.events, (e, ei) -> CASE
    WHEN {_STORED} IS NOT NULL THEN transform({_STORED}.blocks, (blk, i) -> {
    _row(
        **_EVENT,
        event_type="'stored'",
        block_index="i + IF(ei = 0, b.first_event_block_offset, 0)",
        level_after="blk.cache_level",
        block_hash="blk.block_hash",
        parent_hash=f"IF(i = 0, {_STORED}.parent_hash, {_STORED}.blocks[greatest(i - 1, 0)].block_hash)",
        tokens="size(blk.tokens)",
        lora_id="blk.lora_id",
    )
})
    WHEN e.data.member2 IS NOT NULL THEN transform(e.data.member2.block_hashes, (h, i) -> {
    _row(**_EVENT, event_type="'removed'", block_index="i", block_hash="h")
})
    WHEN e.data.member3 IS NOT NULL THEN array({
    _row(
        **_EVENT,
        event_type="'updated'",
        level_before="e.data.member3.cache_level.old_value",
        level_after="e.data.member3.cache_level.new_value",
        block_hash="e.data.member3.block_hash",
    )
})
    ELSE array({_row(**_EVENT, event_type="'created'")})
  END))
)) r
"""
"""One row per block event from the view ``decoded`` (``b``: the decoded batch; Avro unions
become structs of ``member0..3``: Created, Stored, Removed, Updated), in one pass over the
source (dropped reports first, then the events' rows, as the Python exporter orders them)."""

AGGREGATES_SQL = {
    "rows_by_type": "SELECT event_type, count(*) AS n FROM rows GROUP BY event_type",
    "dropped_by_worker": "SELECT concat(instance, '/', attention_dp_rank) AS worker, sum(dropped_events) AS n "
    "FROM rows WHERE event_type = 'dropped' GROUP BY 1",
    "missing_batches_by_instance": "SELECT instance, sum(gap) AS n FROM (SELECT instance, sequence - "
    "lag(sequence) OVER (PARTITION BY instance, producer_id ORDER BY sequence) - 1 AS gap FROM "
    "(SELECT DISTINCT instance, producer_id, sequence FROM rows)) WHERE gap > 0 GROUP BY instance",
    "events_by_type": "SELECT event_type, count(*) AS n FROM (SELECT DISTINCT instance, attention_dp_rank, "
    "event_id, event_type FROM rows WHERE event_type <> 'dropped') GROUP BY event_type",
}
"""The report's counting aggregates, computed by Spark over what it wrote."""


class SparkExportResult(dict[str, Any]):
    """The job's summary (JSON-ready): rows and messages written this run, seconds, aggregates."""


def spark_session(jars: list[Path], *, master: str = "local[2]", driver_memory: str = "1g") -> Any:
    """A local-friendly session: the connector jars, loopback only, no UI, UTC, µs timestamps."""
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    from pyspark.sql import SparkSession

    builder = (
        SparkSession.builder.master(master)
        .appName("kvevents-export")
        .config("spark.jars", ",".join(str(j) for j in jars))
        .config("spark.driver.host", "127.0.0.1")
        .config("spark.driver.bindAddress", "127.0.0.1")
        .config("spark.driver.memory", driver_memory)
        .config("spark.ui.enabled", "false")
        .config("spark.sql.session.timeZone", "UTC")
        .config("spark.sql.parquet.outputTimestampType", "TIMESTAMP_MICROS")
        .config("spark.sql.shuffle.partitions", "2")
        .config("spark.sql.parquet.compression.codec", "zstd")
    )
    session = builder.getOrCreate()
    session.sparkContext.setLogLevel("WARN")
    return session


def run_spark_export(
    spark: Any,
    bootstrap_servers: str,
    topic: str,
    out: Path,
    *,
    follow: bool = False,
    kafka_options: Mapping[str, str] | None = None,
    trigger_interval_s: float = 10.0,
) -> SparkExportResult:
    """Export ``topic`` into ``out`` (what is there now with ``availableNow``; with ``follow``
    every ``trigger_interval_s`` until interrupted), then compute the aggregates."""
    from kvevents.schemas import current_fingerprint
    from kvevents.schemas._avro import batch_schema_json
    from pyspark.sql.avro.functions import from_avro
    from pyspark.sql.functions import col, expr

    out = out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    reader = (
        spark.readStream.format("kafka")
        .option("kafka.bootstrap.servers", bootstrap_servers)
        .option("subscribe", topic)
        .option("startingOffsets", "earliest")
        .option("failOnDataLoss", "false")
    )
    for key, value in (kafka_options or {}).items():
        reader = reader.option(f"kafka.{key}", value)
    raw = reader.load()
    framed = raw.select(
        col("partition").alias("kafka_partition"),
        col("offset").alias("kafka_offset"),
        col("timestamp").alias("kafka_timestamp"),
        expr("substring(value, 1, 10)").alias("header"),
        from_avro(
            expr("substring(value, 11, length(value) - 10)"), batch_schema_json(), {"mode": "PERMISSIVE"}
        ).alias("b"),
    )
    # Only the current schema's header: from_avro has one reader schema, and it would read the
    # body of another writer schema (or garbage) without noticing.
    header = (b"\xc3\x01" + current_fingerprint()).hex().upper()
    valid = expr(f"header = X'{header}' AND b IS NOT NULL")
    framed.where(valid).createOrReplaceTempView("decoded")
    rows = spark.sql(ROWS_SQL)
    malformed = framed.where(~valid).select("kafka_partition", "kafka_offset")
    checkpoints = out / "_spark_checkpoint"

    def start(frame: Any, path: Path, name: str, fmt: str, partitioned: bool) -> Any:
        writer = (
            frame.writeStream.format(fmt)
            .option("path", str(path))
            .option("checkpointLocation", str(checkpoints / name))
        )
        if partitioned:
            writer = writer.partitionBy("date", "instance")
        writer = (
            writer.trigger(processingTime=f"{trigger_interval_s} seconds")
            if follow
            else writer.trigger(availableNow=True)
        )
        return writer.queryName(f"kvevents_{name}_{time.monotonic_ns()}").start()

    started = time.monotonic()
    queries = [
        start(rows, out, "rows", "parquet", True),
        start(malformed, out / "_spark_malformed", "malformed", "json", False),
    ]
    try:
        for query in queries:
            query.awaitTermination()
    except KeyboardInterrupt:
        for query in queries:
            query.stop()
    seconds = time.monotonic() - started
    progress = queries[0].recentProgress
    written = sum(int(p.get("numInputRows", 0)) for p in (json.loads(q.json) for q in progress))
    result = SparkExportResult(
        topic=topic,
        out=str(out),
        messages=written,
        seconds=round(seconds, 3),
        aggregates=aggregates(spark, out),
    )
    (out / "_spark_aggregates.json").write_text(json.dumps(result["aggregates"], indent=1, sort_keys=True))
    return result


def aggregates(spark: Any, out: Path) -> dict[str, dict[str, int]]:
    """:data:`AGGREGATES_SQL` over the rows in ``out`` (as ``{name: {key: count}}``)."""
    spark.read.parquet(str(out)).createOrReplaceTempView("rows")
    return {
        name: {str(k): int(n) for k, n in spark.sql(sql).collect()} for name, sql in AGGREGATES_SQL.items()
    }


def main(argv: list[str] | None = None) -> int:
    """``python -m kvevents.analytics.spark_job BOOTSTRAP TOPIC DIR [--follow]``."""
    import argparse

    from .spark_jars import ensure_spark_jars

    parser = argparse.ArgumentParser(prog="python -m kvevents.analytics.spark_job", description=__doc__)
    parser.add_argument("bootstrap_servers")
    parser.add_argument("topic")
    parser.add_argument("out", type=Path)
    parser.add_argument("--follow", action="store_true")
    parser.add_argument("--master", default="local[2]")
    args = parser.parse_args(argv)
    spark = spark_session(ensure_spark_jars(), master=args.master)
    try:
        result = run_spark_export(spark, args.bootstrap_servers, args.topic, args.out, follow=args.follow)
    finally:
        spark.stop()
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
