"""``kvevents export FORMAT``: the topic republished for other systems.

This module only registers the ``export`` parser and its sub-commands; each format lives in its
own ``kvevents/commands/_export_<name>.py`` with a ``register_export(subparsers)``.
"""

from __future__ import annotations

import argparse

from kvevents.commands import _export_dynamo, _export_parquet, _export_spark, _export_zmq

DESCRIPTION = """\
Republish the events of a kvevents topic for systems that do not read Kafka:

  zmq      vLLM's ZMQ wire format (what llm-d's KV-cache indexer and Dynamo's workers read),
           one stream per worker, gap-free seqs, replay from Kafka
  dynamo   NVIDIA Dynamo RouterEvent JSON lines (file, stdout or ZMQ)
  parquet  one row per block event in a hive-partitioned Parquet directory (date, instance),
           resumable; for DuckDB, pandas, Spark ('kvevents report --parquet DIR')
  spark    the same Parquet layout written by a Spark Structured Streaming job (spark extra)

Run 'kvevents export FORMAT --help' for each format's options.
"""


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``export`` and its formats."""
    parser = subparsers.add_parser(
        "export",
        help="republish the topic for routers that do not read Kafka (vLLM ZMQ, Dynamo JSON) and for analytics (Parquet)",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    formats = parser.add_subparsers(dest="export_format", metavar="FORMAT")
    _export_zmq.register_export(formats)
    _export_dynamo.register_export(formats)
    _export_parquet.register_export(formats)
    _export_spark.register_export(formats)

    def usage(args: argparse.Namespace) -> int:
        parser.print_help()
        return 2

    parser.set_defaults(func=usage)
