"""Attention-DP gather benchmark: kvevents' gather next to the C++ lockstep exchange, same run.

``python bench/gather.py`` launches its own ``mpiexec -n 4`` (this file in ``--worker`` mode),
then prints a table and writes ``bench/results/gather.json``. In the job, each repeat runs both
exchanges one after the other (alternating which goes first), each on a fresh set of managers
built the same way; only the exchange differs (``support/lockstep.py`` is the baseline: blocking
allreduce + blocking size/bytes send/receive every period, same codec, same buffers).

Per exchange and repeat (the exchanges: ``kvevents``; ``kvevents-py``, the same with the manager's
pure-Python engine path instead of the compiled recorder, to compare both in one run;
``lockstep``; and ``none``, the same managers without any exchange: the floor of the engine
thread's cost; ``--protocols`` picks some):

- ``steady``: every rank runs ``--iterations`` engine iterations: 50 enqueues (25 Stored of one
  32-token block, 20 Removed, 5 Updated, prebuilt arguments) + ``flush()``, timed on the engine
  thread, then a sleep (the GPU's share of an iteration, GIL released): one phase per
  ``--gaps-ms`` value, by default 10 ms (iterations slower than the 5 ms period, as decode steps
  usually are) and 3 ms (iterations faster than the period), with rank 0's manager drained by a
  reader thread; then the first gap again with rank 0's manager drained by a ``KafkaEventSink``
  on a local broker (as deployed; skipped with ``--no-kafka``). Reported: the engine thread's
  cost per iteration on ranks != 0; the latency of every event of ranks != 0 from the start
  of the iteration that enqueued it to its arrival in rank 0's buffer (the moment
  ``EventBuffer.extend`` returns; CLOCK_MONOTONIC is shared by the processes) and, with the
  sink, to Kafka's acknowledgement; each rank's CPU use (all threads).
- ``idle``: no events for 2 s (after the managers' workers parked): each rank's CPU use.
- ``throughput``: the ranks offer ``--offered-rate`` events/s together (each its share, in
  iterations of 50 on a fixed schedule; a rank behind schedule does not sleep) until each has
  enqueued ``--throughput-events``. Reported: events/s acknowledged by Kafka (through the sink)
  and events/s into rank 0's buffer, all four ranks together, from the start barrier to the last
  acknowledgement / arrival; equal to the offered rate when the pipeline keeps up.

The ranks' side is ``support/gather_worker.py`` (one rank's cases, ``--worker`` mode), the
medians and the table's rows ``support/gather_report.py``; this file parses the arguments, runs
``mpiexec``, prints the table and writes the JSON.

The machine has 2 cores for 4 ranks (and other work): both exchanges share that. MPICH's blocking
calls spin while they wait, which costs more when ranks outnumber cores than it does with one
core per rank.

    python bench/gather.py            # full run
    python bench/gather.py --quick    # smoke run
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent / "support"))

from gather_report import print_table, summarize, table_rows
from gather_worker import EVENTS_PER_ITERATION, worker
from kvevents.producer import find_mpiexec

RESULTS = Path(__file__).resolve().parent / "results" / "gather.json"
RANKS = 4
PROTOCOLS = ("kvevents", "kvevents-py", "lockstep", "none")
TARGETS = {"engine_us_per_iteration": 50.0, "latency_p99_periods": 2.0, "throughput_events_per_s": 200_000}


@contextlib.contextmanager
def kafka_broker(args: argparse.Namespace) -> Iterator[str | None]:
    """``KAFKA_BOOTSTRAP_SERVERS`` if set, else a local broker for the run; None with --no-kafka."""
    if args.no_kafka:
        yield None
        return
    if importlib.util.find_spec("kvevents.producer.sink") is None:
        print(
            "kvevents.producer.sink is not installed: rank 0 drains into a reader, not Kafka", file=sys.stderr
        )
        yield None
        return
    if os.environ.get("KAFKA_BOOTSTRAP_SERVERS"):
        yield os.environ["KAFKA_BOOTSTRAP_SERVERS"]
        return
    from kvevents.broker import LocalBroker

    with tempfile.TemporaryDirectory(prefix="bench-gather-broker-") as state:
        # The JVM's own defaults (C2 JIT) for a throughput run, not the fast-start flags, unless
        # KVEVENTS_BROKER_JVM_OPTS says otherwise.
        jvm = None if "KVEVENTS_BROKER_JVM_OPTS" in os.environ else ()
        broker = LocalBroker(Path(state) / "state", stop_with_parent=True, jvm_options=jvm)
        broker.start()
        try:
            yield broker.bootstrap_servers
        finally:
            broker.stop()


def launch(args: argparse.Namespace, argv: list[str]) -> int:
    mpiexec = find_mpiexec()
    if mpiexec is None:
        print(
            f"mpiexec not found beside {sys.executable} nor on PATH: pip install -e '.[dev]'", file=sys.stderr
        )
        return 2
    with tempfile.TemporaryDirectory(prefix="bench-gather-") as tmp, kafka_broker(args) as bootstrap:
        command = [
            mpiexec, "-n", str(RANKS), sys.executable, str(Path(__file__).resolve()), "--worker",
            "--out", tmp, "--repeats", str(args.repeats), "--iterations", str(args.iterations),
            "--throughput-events", str(args.throughput_events), "--offered-rate", str(args.offered_rate),
            "--period-ms", str(args.period_ms), "--protocols", ",".join(args.protocols),
            "--gaps-ms", ",".join(f"{g:g}" for g in args.gaps_ms), "--idle-s", str(args.idle_s),
            *(["--bootstrap", bootstrap] if bootstrap else []),
        ]  # fmt: skip
        started = time.monotonic()
        try:
            subprocess.run(command, check=True, timeout=args.timeout)
        except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as exc:
            print(f"the MPI job failed: {exc}", file=sys.stderr)
            return 1
        seconds = time.monotonic() - started
        cases = {r: json.loads((Path(tmp) / f"rank{r}.json").read_text()) for r in range(RANKS)}
    summary = summarize(cases, args)
    k, b = summary["kvevents"], summary["lockstep"]

    def rate(entry: dict[str, Any]) -> float:
        """Into Kafka when the run had a broker, else into rank 0's buffer."""
        return float(entry["kafka_events_per_s"] or entry["throughput_events_per_s"])

    period = args.period_ms
    gaps = list(cases[0][0]["steady"])  # phase labels: one per gap, then one with the Kafka sink
    document = {
        "benchmark": "gather",
        "command": " ".join(["python bench/gather.py", *argv]),
        "measured_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "seconds": round(seconds, 1),
        "machine": {
            "python": sys.version.split()[0],
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
        },
        "config": {
            "ranks": RANKS,
            "repeats": args.repeats,
            "iterations": args.iterations,
            "events_per_iteration": EVENTS_PER_ITERATION,
            "gaps_ms": args.gaps_ms,
            "period_ms": period,
            "throughput_events_per_rank": args.throughput_events,
            "throughput_offered_events_per_s": args.offered_rate,
            "idle_s": args.idle_s,
            "protocols": list(args.protocols),
        },
        "protocols": summary,
        "ratios_lockstep_over_kvevents": {
            key: (b[key] / k[key] if k[key] else None) for key, _, _, _ in table_rows(gaps, period)
        },
        "ratios_pure_python_over_compiled_engine_path": {
            key: (summary["kvevents-py"][key] / k[key] if k[key] else None)
            for key, _, _, _ in table_rows(gaps, period)
        }
        if "kvevents-py" in summary
        else None,
        "targets": {
            "engine_us_per_iteration_p50": TARGETS["engine_us_per_iteration"],
            "latency_ms_p99": TARGETS["latency_p99_periods"] * period,
            "throughput_events_per_s": TARGETS["throughput_events_per_s"],
            "throughput_into": "Kafka (acknowledged)" if k["kafka_events_per_s"] else "rank 0's buffer",
            "kafka": (
                "KAFKA_BOOTSTRAP_SERVERS"
                if os.environ.get("KAFKA_BOOTSTRAP_SERVERS")
                else f"local broker, JVM options {os.environ.get('KVEVENTS_BROKER_JVM_OPTS', 'the JVM defaults')!r}"
            )
            if k["kafka_events_per_s"]
            else None,
        },
        "meets_targets": {
            **{
                f"gap{g}_{name}": ok
                for g in gaps
                for name, ok in (
                    (
                        "engine_us_per_iteration",
                        k[f"gap{g}_engine_us_p50"] <= TARGETS["engine_us_per_iteration"],
                    ),
                    ("latency_p99", k[f"gap{g}_latency_ms_p99"] <= TARGETS["latency_p99_periods"] * period),
                    (
                        "engine_not_worse_than_lockstep",
                        k[f"gap{g}_engine_us_p50"] <= b[f"gap{g}_engine_us_p50"],
                    ),
                    (
                        "latency_p99_better_than_lockstep",
                        k[f"gap{g}_latency_ms_p99"] < b[f"gap{g}_latency_ms_p99"],
                    ),
                )
            },
            "throughput": rate(k) >= TARGETS["throughput_events_per_s"],
            "throughput_not_worse_than_lockstep": rate(k) >= rate(b),
        },
    }
    print_table(summary, gaps, period)
    print("\nmeets targets:", ", ".join(f"{name}={ok}" for name, ok in document["meets_targets"].items()))
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(document, indent=2, sort_keys=True) + "\n")
    print(f"\nwrote {args.output}")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=4,
        help="repeats (default 4: with 4 protocols, each runs once in every position)",
    )
    parser.add_argument("--iterations", type=int, default=1000, help="steady engine iterations per rank")
    parser.add_argument(
        "--gaps-ms",
        type=lambda text: [float(g) for g in text.split(",")],
        default=[10.0, 3.0],
        help="steady phases: GIL-free pause after each iteration (GPU time), comma-separated",
    )
    parser.add_argument("--period-ms", type=float, default=5.0, help="attention_dp_events_gather_period_ms")
    parser.add_argument(
        "--throughput-events", type=int, default=250_000, help="events per rank, throughput phase"
    )
    parser.add_argument(
        "--offered-rate",
        type=float,
        default=300_000,
        help="throughput phase: events/s the 4 ranks offer together",
    )
    parser.add_argument("--idle-s", type=float, default=2.0)
    parser.add_argument(
        "--protocols",
        type=lambda text: tuple(text.split(",")),
        default=PROTOCOLS,
        help=f"comma-separated, from {','.join(PROTOCOLS)} (kvevents and lockstep are required)",
    )
    parser.add_argument("--timeout", type=float, default=1800, help="seconds before the MPI job is killed")
    parser.add_argument("--quick", action="store_true", help="a smoke run")
    parser.add_argument("--output", type=Path, default=RESULTS)
    parser.add_argument("--no-kafka", action="store_true", help="rank 0 drains into nothing instead of Kafka")
    parser.add_argument("--bootstrap", help=argparse.SUPPRESS)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if not {"kvevents", "lockstep"} <= set(args.protocols) or not set(args.protocols) <= set(PROTOCOLS):
        parser.error(f"--protocols: kvevents and lockstep, and any of {PROTOCOLS}")
    if args.quick:
        args.repeats, args.iterations, args.throughput_events, args.idle_s = 1, 200, 50_000, 0.5
    if args.worker:
        worker(args)
        return 0
    return launch(args, argv)


if __name__ == "__main__":
    raise SystemExit(main())
