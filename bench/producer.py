"""Producer benchmark: what kvevents costs an engine, and how fast the producer moves events.

Sections (run all, or pick with ``--sections``; each writes its own key of the JSON, so a run of
one section keeps the others' last results):

- ``engine_thread``: cost per call of each ``enqueue_*`` and of ``flush()`` on the engine thread,
  next to the naive baseline (the same API building the full event objects on the engine thread,
  as a line-by-line port of the C++ does), in the same run. Scenarios: a consumer draining; the
  buffer full with nobody draining (every flush drops); and ``saturated`` (no pause between
  iterations, so the worker competes with the engine for the GIL all the time).
- ``worker``: how many events per second the background worker builds and buffers.
- ``sink_engine_kafka_down``, ``sink_latency``, ``sink_throughput``: the Kafka sink (broker:
  ``KAFKA_BOOTSTRAP_SERVERS``, else a local one): the engine thread's cost with the broker down,
  flush() to acknowledgement per linger.ms, and events/s against raw confluent-kafka.

The sections live in ``support/producer_*.py``: ``producer_engine`` (engine_thread, worker; the
baselines in ``producer_baselines``, the operations in ``producer_ops``, the timing in
``producer_timing``), ``producer_kafka_down``, ``producer_latency`` and ``producer_throughput``
(the sink sections; their broker in ``producer_kafka``, per-thread CPU in ``producer_cpu``); the
tables in ``producer_report``.

An engine iteration here is ``--calls`` calls of one operation, timed as a block (per call = block
/ calls; the Python loop and call overhead are included, the ``noop`` row shows them), then
``flush()``, timed alone, then ``--gap-ms`` of sleep standing for the GPU work during which a real
engine releases the GIL (the worker and consumer run then). Each repeat runs ``--iterations``
iterations; best = the fastest repeat's mean, median = the median of the repeats' means,
worst_iteration = the slowest single iteration of all (per call), which shows any blocking.

    python bench/producer.py              # full run, table + bench/results/producer.json
    python bench/producer.py --quick      # a smoke run
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import sys
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent / "support"))

from producer_engine import bench_engine_thread, bench_worker_throughput
from producer_kafka import BROKER
from producer_kafka_down import bench_sink_engine_kafka_down
from producer_latency import bench_sink_latency
from producer_report import (
    print_engine_table,
    print_sink_engine,
    print_sink_latency,
    print_sink_throughput,
    print_worker_table,
)
from producer_throughput import bench_sink_throughput

RESULTS = Path(__file__).resolve().parent / "results" / "producer.json"


SECTIONS: dict[str, Callable[[argparse.Namespace], dict[str, Any]]] = {
    "engine_thread": bench_engine_thread,
    "worker": bench_worker_throughput,
    "sink_engine_kafka_down": bench_sink_engine_kafka_down,
    "sink_latency": bench_sink_latency,
    "sink_throughput": bench_sink_throughput,  # last: it writes GBs, whose writeback slows the broker a while
}
"""Section name -> function returning its JSON. Other parts of the producer add theirs here."""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--sections", default=",".join(SECTIONS), help="comma-separated: " + ", ".join(SECTIONS)
    )
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--iterations", type=int, default=300, help="engine iterations per repeat")
    parser.add_argument("--calls", type=int, default=50, help="calls of the operation per iteration")
    parser.add_argument("--gap-ms", type=float, default=2.0, help="GIL-free pause between iterations")
    parser.add_argument("--full-capacity", type=int, default=1000, help="buffer size of the full scenario")
    parser.add_argument("--sink-events", type=int, default=300_000, help="events per sink throughput run")
    parser.add_argument("--sink-repeats", type=int, default=5, help="repeats of each sink run")
    parser.add_argument(
        "--sink-pause", type=float, default=2.0, help="seconds of rest for the broker between runs"
    )
    parser.add_argument("--sink-lingers", type=lambda v: [float(x) for x in v.split(",")], default=[0.0, 5.0, 20.0],
                        help="linger.ms values of the latency runs (comma-separated)")  # fmt: skip
    parser.add_argument(
        "--latency-seconds", type=float, default=5.0, help="seconds of offered load per latency run"
    )
    parser.add_argument("--rate", type=int, default=100_000, help="offered events/s of the latency runs")
    parser.add_argument("--quick", action="store_true", help="a smoke run: few repeats and iterations")
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    logging.getLogger("kvevents").setLevel(logging.ERROR)  # the full scenario drops on purpose
    if args.quick:
        args.repeats, args.iterations = 2, 30
        args.sink_events, args.sink_repeats, args.latency_seconds, args.sink_pause = 20_000, 1, 1.0, 0.2
    chosen = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = [s for s in chosen if s not in SECTIONS]
    if unknown:
        parser.error(f"unknown sections {unknown}; choose from {list(SECTIONS)}")

    document: dict[str, Any] = {}
    if args.output.exists():
        try:
            document = json.loads(args.output.read_text())
        except json.JSONDecodeError:
            document = {}
    document.setdefault("sections", {})
    document["benchmark"] = "producer"
    document["machine"] = {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
    }
    try:
        _run_sections(chosen, args, argv, document)
    finally:
        BROKER.stop()
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(document, indent=2, sort_keys=True) + "\n")
    print(f"\nwrote {args.output}")
    return 0


PRINTERS: dict[str, Callable[[dict[str, Any]], None]] = {
    "engine_thread": print_engine_table,
    "worker": print_worker_table,
    "sink_engine_kafka_down": print_sink_engine,
    "sink_latency": print_sink_latency,
    "sink_throughput": print_sink_throughput,
}


def _run_sections(
    chosen: list[str], args: argparse.Namespace, argv: list[str] | None, document: dict[str, Any]
) -> None:
    for name in chosen:
        started = time.perf_counter()
        result = SECTIONS[name](args)
        result["measured_at"] = datetime.now(UTC).isoformat(timespec="seconds")
        result["seconds"] = round(time.perf_counter() - started, 1)
        result["command"] = " ".join(
            ["python bench/producer.py", *(argv if argv is not None else sys.argv[1:])]
        )
        document["sections"][name] = result
        PRINTERS[name](result)


if __name__ == "__main__":
    raise SystemExit(main())
