"""``kvevents export spark``: the Spark Structured Streaming job writing the Parquet layout."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from kvevents.commands._common import (
    CommandError,
    Progress,
    add_kafka_flags,
    add_output_flags,
    command,
    kafka_config,
    resolve_bootstrap,
)

DESCRIPTION = """\
Run the Spark Structured Streaming job of kvevents (kvevents.analytics.spark_job): Spark's Kafka
source reads the topic, spark-avro's from_avro decodes each batch after its 10-byte header, and
a file sink writes the same rows and layout as 'kvevents export parquet' into DIR (DIR/date=.../
instance=.../part-*.parquet), exactly once, resuming from DIR/_spark_checkpoint. Messages that do
not decode are listed in DIR/_spark_malformed. At the end it computes the report's counting
aggregates over DIR (DIR/_spark_aggregates.json) and prints a JSON summary.

Needs the spark extra (pip install 'kvevents[spark]': pyspark 4.2, ~490 MB) and Java 17; the
connector jars are fetched from Maven Central with mvn into the kvevents cache the first time.
--master local[2] by default; give a cluster's master URL to run it there (the jars are passed
as spark.jars). Spark takes 15-60 s to start.
"""


def register_export(formats: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``export spark``."""
    parser = formats.add_parser(
        "spark",
        help="the same Parquet layout written by a Spark Structured Streaming job (spark extra)",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("out", type=Path, metavar="DIR", help="the output directory (created if missing)")
    parser.add_argument(
        "--follow",
        "-f",
        action="store_true",
        help="keep running (a micro-batch every --interval seconds) until Ctrl-C",
    )
    parser.add_argument(
        "--interval",
        type=float,
        default=10.0,
        metavar="SECONDS",
        help="micro-batch interval with --follow (default: 10)",
    )
    parser.add_argument("--master", default="local[2]", help="Spark master URL (default: local[2])")
    parser.add_argument("--driver-memory", default="1g", help="spark.driver.memory (default: 1g)")
    add_kafka_flags(parser)
    add_output_flags(parser, json_help="print the summary as JSON (the default output is JSON too)")
    parser.set_defaults(func=run)


@command("export spark")
def run(args: argparse.Namespace) -> int:
    """Run ``kvevents export spark``."""
    try:
        import pyspark  # noqa: F401
    except ImportError:
        raise CommandError(
            "pyspark is missing: install the spark extra (pip install 'kvevents[spark]')", code=2
        ) from None
    from kvevents.analytics.spark_jars import ensure_spark_jars
    from kvevents.analytics.spark_job import run_spark_export, spark_session
    from kvevents.broker.jars import FetchError

    bootstrap = resolve_bootstrap(args)
    show = Progress(enabled=not args.quiet)
    show.update("fetching the Spark jars (once) and starting Spark ...", force=True)
    try:
        jars = ensure_spark_jars()
    except FetchError as exc:
        raise CommandError(str(exc)) from exc
    spark = spark_session(jars, master=args.master, driver_memory=args.driver_memory)
    show.update(f"Spark started; exporting {args.topic} into {args.out}", force=True)
    try:
        result = run_spark_export(
            spark, bootstrap, args.topic, args.out, follow=args.follow,
            kafka_options=kafka_config(args), trigger_interval_s=args.interval,
        )  # fmt: skip
    finally:
        spark.stop()
    show.done()
    print(json.dumps(result))
    return 0
