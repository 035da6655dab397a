"""End-to-end freshness: engine ``flush()`` -> batch applied to a live index, and where the time goes.

``python bench/freshness.py`` runs the real pipeline (``mpiexec -n RANKS kvevents simulate`` ->
the broker at ``KAFKA_BOOTSTRAP_SERVERS``, else a local one -> an ``EventReader`` applying every
message to a ``CacheIndex`` with ``apply_encoded``) at a few request rates, and for the events of
one message in ``--sample`` reports p50/p99/max of the whole path and of its stages:

- ``sink``: rank 0's ``flush()`` -> the batch's ``created_at_us`` (the manager's worker, the sink
  thread's drain, chunking and encoding, its queue), for rank 0's own events;
- ``gather_sink``: the same for the events of ranks != 0, which first cross the attention-DP
  gather (MPI) to rank 0;
- ``produce``: ``created_at_us`` -> the broker's append time (the topic is created with
  ``message.timestamp.type=LogAppendTime``): librdkafka's linger and batching, compression,
  the request, the broker's append;
- ``fetch``: append -> the message handed to the application (the consumer's fetch, librdkafka's
  queue, earlier messages of the same poll being applied);
- ``apply``: ``apply_encoded`` itself.

``gc n/max``: the broker's stop-the-world GC pauses while a step's events were produced (its
``-Xlog:gc`` file, ``kvevents.broker.gclog``: known for a broker this bench starts, else
``--broker-gc-log``), and ``in gc`` the share of the slowest 1% of ``produce`` samples that
waited through one of them.

All share one machine's clocks: the ranks log ``time.monotonic()`` per flush
(``--flush-log``), the wall-clock stamps are moved onto the monotonic clock with this process's
offset. Messages are decoded after the step, so the measuring consumer does only what a router
does. Latencies leave out the events of each step's first ``--settle`` seconds (the producer
connecting and learning the new topic, once per sink), shown apart as ``+start``; each step
also reports the cores in use (the whole machine, the ranks, this consumer, the rest: the broker
and whatever else runs here), because on a busy 2-core machine the tail is CPU queueing.
``--try NAME:KEY=VALUE`` runs other producer settings side by side (order alternated per repeat).

``--compare`` runs the settings before this issue's change (:data:`BEFORE_PRODUCER`,
:data:`BEFORE_CONSUMER`) and the current defaults side by side, interleaved per rate, steps
both up to their highest drop-free rate and ends with a flat-out run of each. ``measure()`` is
the entry point for ``bench/index.py``.

    python bench/freshness.py                 # current defaults, a few rates (about 1 min)
    python bench/freshness.py --compare       # before vs after, up to the drop-free rate
    python bench/freshness.py --baseline-python ../main/.venv/bin/python --repeats 3
                                              # this checkout's code vs another's, interleaved
    python bench/freshness.py --rates 80,160 --repeats 4 --try none:compression.type=none
                                              # a producer setting side by side with the defaults
    python bench/freshness.py --rates 640 --repeats 4 --try-simulate 'slack0:--pace-slack-ms 0'
                                              # engine flags (kvevents simulate) side by side
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from confluent_kafka import TIMESTAMP_LOG_APPEND_TIME
from kvevents.consumer import EventReader
from kvevents.consumer.topics import TopicSpec, create_topic
from kvevents.producer import find_mpiexec

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent / "support"))
import e2e
from e2e import kafka_broker_and_gc_log, quantiles
from freshness_report import print_table, summary_line
from freshness_stages import STAGES, broker_gc, cpu_report, cpu_ticks, stage_latencies, wall_minus_monotonic

RESULTS = Path(__file__).resolve().parent / "results" / "freshness.json"
DEFAULT_RATES = (10.0, 160.0, 640.0)
"""Requests/s per rank (4 ranks): about 0.3k, 20k and 60-90k events/s, the last ``bench/e2e.py``'s
highest drop-free step on this machine (saturated: the simulated engines fall behind)."""

BEFORE_PRODUCER: dict[str, str] = {"linger.ms": "5", "socket.nagle.disable": "false"}
"""The sink's librdkafka defaults before the freshness change (``docs/OPERATIONS.md``)."""
BEFORE_CONSUMER: dict[str, Any] = {"socket.nagle.disable": False}
"""The reader's librdkafka defaults before the freshness change."""


class Tail(e2e.Tail):
    """Applies every message to an index as it arrives; keeps one in ``sample`` (bytes, append
    time, handed-over and applied times) to decode after the step."""

    def __init__(self, bootstrap: str, topic: str, config: Mapping[str, Any], sample: int) -> None:
        self.samples: list[tuple[bytes, int, float, float]] = []  # value, append ms, handed, applied
        super().__init__(EventReader(bootstrap, topic, config=dict(config)), sample)

    def observe(self, message: Any, value: bytes, handed: float, applied: float) -> None:
        kind, stamp = message.timestamp()
        self.samples.append((value, stamp if kind == TIMESTAMP_LOG_APPEND_TIME else -1, handed, applied))


def engine_speed(rate: float) -> float:
    """Engine iterations/s for a request rate (as ``bench/e2e.py``: its capacity grows with it)."""
    return max(100.0, 10.0 * rate)


def run_step(
    bootstrap: str,
    rate: float,
    *,
    ranks: int = 4,
    duration: float = 5.0,
    producer: Mapping[str, str] | None = None,
    consumer: Mapping[str, Any] | None = None,
    sample: int = 4,
    realtime: bool = True,
    python: str | None = None,
    settle_s: float = 1.0,
    simulate_args: Sequence[str] = (),
    gc_log: Path | None = None,
) -> dict[str, Any]:
    """One run of the simulators at ``rate`` requests/s per rank (``realtime=False``: as fast as
    they can, ``--no-realtime``); the step's figures. Latencies count the events flushed
    ``settle_s`` or more after the step's first flush (``e2e_with_start``: all of them). ``python``: the interpreter of the ranks
    (another checkout's venv runs that checkout's kvevents, with the ``mpiexec`` beside it).
    ``gc_log``: the broker's GC log, for ``broker_gc``."""
    python = python or sys.executable
    beside = Path(python).parent / "mpiexec"
    mpiexec = str(beside) if beside.exists() else find_mpiexec()
    if not mpiexec:
        raise SystemExit("mpiexec not found: pip install -e '.[dev]'")
    topic = f"bench-fresh-{uuid.uuid4().hex[:10]}"
    create_topic(bootstrap, TopicSpec(topic, configs={"message.timestamp.type": "LogAppendTime"}))
    offset = wall_minus_monotonic()
    with tempfile.TemporaryDirectory(prefix="bench-fresh-") as tmp:
        work = Path(tmp)
        tail = Tail(bootstrap, topic, consumer or {}, sample)
        try:
            command = [
                mpiexec, "-n", str(ranks), python, "-m", "kvevents.cli", "simulate",
                "--rate", str(rate), "-b", bootstrap, "--topic", topic, "--json", "-q",
                "--flush-log", str(work), "--iterations-per-second", str(engine_speed(rate)),
                "--duration", str(duration),
            ]  # fmt: skip
            if not realtime:
                command.append("--no-realtime")
            command += simulate_args  # --try-simulate: a variant's own engine flags
            for key, value in (producer or {}).items():
                command += ["-X", f"{key}={value}"]
            ticks0, children0, self0 = (
                cpu_ticks(),
                resource.getrusage(resource.RUSAGE_CHILDREN),
                time.process_time(),
            )
            started = time.monotonic()
            proc = subprocess.run(command, capture_output=True, text=True, timeout=duration * 4 + 120)
            seconds = time.monotonic() - started
            children1, self1, ticks1 = (
                resource.getrusage(resource.RUSAGE_CHILDREN),
                time.process_time(),
                cpu_ticks(),
            )
            if proc.returncode != 0:
                raise SystemExit(
                    f"simulate failed ({proc.returncode}):\n{proc.stdout[-1000:]}\n{proc.stderr[-3000:]}"
                )
            summary = json.loads(proc.stdout)
            caught_up = tail.wait_for(summary["messages_delivered"] or 0, timeout=60)
        finally:
            tail.close()
        spans: list[tuple[float, float]] = []
        latencies = stage_latencies(tail, work, offset, settle_s, spans)
    ranks_s = (children1.ru_utime + children1.ru_stime) - (children0.ru_utime + children0.ru_stime)
    cpu = cpu_report((ticks0, ticks1), ranks_s, self1 - self0, seconds)
    per_rank = summary["per_rank"]
    kafka = next((r["kafka"] for r in per_rank if r.get("kafka")), None) or {}
    expected = duration * engine_speed(rate)
    return {
        "rate_per_rank": rate,
        "ranks": ranks,
        "events": summary["events"],
        "events_per_second": summary["events_per_second"],
        "drops": summary["drops"],
        "events_lost_unreported": summary["events_lost_unreported"],
        "realtime": realtime,
        "kept_pace": not realtime or min(r["iterations"] for r in per_rank) >= 0.9 * expected,
        "pace": round(min(r["iterations"] for r in per_rank) / expected, 3),
        "index_caught_up": caught_up,
        "events_sampled": len(latencies["e2e"]),
        "settle_s": settle_s,
        "e2e": quantiles(latencies["e2e"]),
        "e2e_with_start": quantiles(latencies["e2e_all"]),
        "cpu": cpu,
        "stages": {name: quantiles(latencies[name]) for name in STAGES},
        "sink_delivery_ack_ms": {
            "p50": None if kafka.get("delivery_p50_s") is None else round(kafka["delivery_p50_s"] * 1000, 2),
            "p99": None if kafka.get("delivery_p99_s") is None else round(kafka["delivery_p99_s"] * 1000, 2),
        },
        "broker_gc": broker_gc(gc_log, spans, offset),
        "loadavg_1m": os.getloadavg()[0],
    }


def drop_free(step: Mapping[str, Any]) -> bool:
    """As ``bench/e2e.py``: nothing dropped, nothing lost unreported (pace is reported apart)."""
    return not step["drops"] and not step["events_lost_unreported"]


def sustained(step: Mapping[str, Any]) -> bool:
    """Drop-free AND the simulated engines kept their real-time pace: a rate this machine carried.
    A step where they fell behind measured a saturated machine (every process queueing for the
    2 cores), not the pipeline at that rate: its latency is reported, apart."""
    return drop_free(step) and bool(step["kept_pace"])


def measure(
    bootstrap: str | None = None,
    rates: Sequence[float] = DEFAULT_RATES,
    *,
    ranks: int = 4,
    duration: float = 5.0,
    sample: int = 4,
    variants: Mapping[str, tuple[Mapping[str, str], Mapping[str, Any]]] | None = None,
    stop_at_drops: bool = True,
    warm_up: bool = True,
    reverse: bool = False,
    flat_out: bool = False,
    pythons: Mapping[str, str] | None = None,
    settle_s: float = 1.0,
    simulate_args: Mapping[str, Sequence[str]] | None = None,
    gc_log: Path | None = None,
) -> dict[str, Any]:
    """Freshness at each rate for each variant (name -> (producer -X settings, reader config);
    default: only the current defaults), interleaved per rate (in reverse order when
    ``reverse``). A variant stops stepping after
    its first rate with drops or where the simulators could not keep real time (when
    ``stop_at_drops``, as ``bench/e2e.py`` steps). ``flat_out``: then one run per variant at the
    last rate as fast as the simulators go (the most this machine's pipeline carries). ``pythons``:
    the ranks' interpreter per variant (default this one); ``simulate_args``: extra ``kvevents
    simulate`` flags per variant (default none); ``gc_log``: the GC log of the broker at
    ``bootstrap`` (found by itself for a broker this bench starts). Returns ``{"variants": {name: {"steps",
    "highest_drop_free"}}, "kafka", "loadavg"}``."""
    variants = dict(variants or {"defaults": ({}, {})})
    steps: dict[str, list[dict[str, Any]]] = {name: [] for name in variants}
    stopped: set[str] = set()
    order = list(variants.items())[:: -1 if reverse else 1]
    load_start = os.getloadavg()
    with kafka_broker_and_gc_log(bootstrap) as (servers, kafka, own_gc_log):
        gc_log = gc_log or own_gc_log
        if warm_up:
            run_step(servers, rates[0], ranks=ranks, duration=2.0, sample=sample)
        for rate in rates:
            for name, (producer, consumer) in order:
                if name in stopped:
                    continue
                step = run_step(
                    servers,
                    rate,
                    ranks=ranks,
                    duration=duration,
                    producer=producer,
                    consumer=consumer,
                    sample=sample,
                    python=(pythons or {}).get(name),
                    settle_s=settle_s,
                    simulate_args=(simulate_args or {}).get(name, ()),
                    gc_log=gc_log,
                )
                steps[name].append(step)
                print(f"  {name:>8} {rate:g}/s per rank: {summary_line(step)}", file=sys.stderr)
                if stop_at_drops and not sustained(step):
                    stopped.add(name)
        flat: dict[str, dict[str, Any]] = {}
        for name, (producer, consumer) in order if flat_out else ():
            flat[name] = run_step(
                servers,
                rates[-1],
                ranks=ranks,
                duration=duration,
                producer=producer,
                consumer=consumer,
                sample=sample,
                realtime=False,
                python=(pythons or {}).get(name),
                settle_s=settle_s,
                simulate_args=(simulate_args or {}).get(name, ()),
                gc_log=gc_log,
            )
            print(f"  {name:>8} flat out: {summary_line(flat[name])}", file=sys.stderr)
    result: dict[str, Any] = {
        "variants": {},
        "kafka": kafka,
        "loadavg_start": load_start,
        "loadavg_end": os.getloadavg(),
    }
    for name, (producer, consumer) in variants.items():
        clean = [s for s in steps[name] if drop_free(s)]
        carried = [s for s in clean if sustained(s)]
        best = max(clean, key=lambda s: s["events_per_second"], default=None)
        result["variants"][name] = {
            "producer_overrides": dict(producer),
            "consumer_overrides": dict(consumer),
            "steps": steps[name],
            "highest_drop_free": best,
            "worst_drop_free_p99_ms": max((s["e2e"]["p99_ms"] or 0 for s in clean), default=None),
            "highest_sustained": max(carried, key=lambda s: s["events_per_second"], default=None),
            "worst_sustained_p99_ms": max((s["e2e"]["p99_ms"] or 0 for s in carried), default=None),
            "saturated_steps": [s["rate_per_rank"] for s in clean if not sustained(s)],
            "flat_out": flat.get(name),
        }
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--rates", default=None, help="comma-separated requests/s per rank (default 10,160,640)"
    )
    parser.add_argument("--ranks", type=int, default=4, help="attention-DP ranks (default 4)")
    parser.add_argument("--duration", type=float, default=5.0, help="seconds per step (default 5)")
    parser.add_argument("--sample", type=int, default=4, help="decode one message in N (default 4)")
    parser.add_argument(
        "--compare",
        action="store_true",
        help="also run the settings from before the freshness change, interleaved per rate, "
        "stepping each up to its first rate with drops or lost pace, as bench/e2e.py does, then "
        "one flat-out run each (--no-realtime; default rates 10,160,320,640,960)",
    )
    parser.add_argument(
        "--baseline-python",
        default=None,
        help="also run every step with this interpreter (another checkout's venv: its kvevents code, "
        "default settings) as variant 'baseline', interleaved per rate: a change side by side with "
        "the code before it",
    )
    parser.add_argument(
        "--try",
        dest="tries",
        action="append",
        default=[],
        metavar="NAME:KEY=VALUE[,KEY=VALUE]",
        help="also run a variant with these producer settings (-X of the ranks' sink), interleaved "
        "per rate with the defaults; repeatable (e.g. --try none:compression.type=none)",
    )
    parser.add_argument(
        "--try-simulate",
        dest="try_simulate",
        action="append",
        default=[],
        metavar="NAME:FLAGS",
        help="also run a variant whose ranks get these extra 'kvevents simulate' flags (space "
        "separated), interleaved per rate with the defaults; repeatable (e.g. "
        "--try-simulate 'slack0:--pace-slack-ms 0')",
    )
    parser.add_argument(
        "--flat-out",
        action="store_true",
        help="end each run with one flat-out run per variant at the last rate (--no-realtime; --compare does)",
    )
    parser.add_argument(
        "--settle",
        type=float,
        default=1.0,
        help="seconds at the start of each step whose events the latencies leave out (the producer "
        "connecting and learning the new topic: a one-time cost, reported apart as '+start'; default 1)",
    )
    parser.add_argument("--repeats", type=int, default=1, help="run everything this many times (default 1)")
    parser.add_argument(
        "-b", "--bootstrap-servers", default=None, help="default: $KAFKA_BOOTSTRAP_SERVERS or a local broker"
    )
    parser.add_argument(
        "--broker-gc-log",
        type=Path,
        default=None,
        help="the GC log of the broker given by -b / $KAFKA_BOOTSTRAP_SERVERS (a kvevents local "
        "broker writes STATE_DIR/gc.log), for the 'gc' columns; a broker this bench starts is found by itself",
    )
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    if args.rates:
        rates = [float(r) for r in args.rates.split(",")]
    else:
        rates = [10.0, 160.0, 320.0, 640.0, 960.0] if args.compare else list(DEFAULT_RATES)
    variants: dict[str, tuple[Mapping[str, str], Mapping[str, Any]]] = {}
    if args.compare:
        variants["before"] = (BEFORE_PRODUCER, BEFORE_CONSUMER)
    variants["after" if args.compare else "defaults"] = ({}, {})
    for spec in args.tries:
        name, _, settings = spec.partition(":")
        pairs = [kv.partition("=") for kv in settings.split(",") if kv]
        if not name or not pairs or any(not k or not eq for k, eq, _ in pairs):
            parser.error(f"--try wants NAME:KEY=VALUE[,KEY=VALUE], got {spec!r}")
        variants[name] = ({k: v for k, _, v in pairs}, {})
    extra_simulate: dict[str, list[str]] = {}
    for spec in args.try_simulate:
        name, _, flags = spec.partition(":")
        if not name or not flags.split() or name in variants:
            parser.error(f"--try-simulate wants a new NAME:FLAGS, got {spec!r}")
        variants[name] = ({}, {})
        extra_simulate[name] = flags.split()
    pythons: dict[str, str] = {}
    if args.baseline_python:
        variants["baseline"] = ({}, {})
        pythons["baseline"] = args.baseline_python
    started = time.monotonic()
    runs = [
        measure(args.bootstrap_servers, rates, ranks=args.ranks, duration=args.duration, sample=args.sample,
                variants=variants, stop_at_drops=args.compare, warm_up=i == 0, flat_out=args.compare or args.flat_out, reverse=i % 2 == 1,
                pythons=pythons, settle_s=args.settle, simulate_args=extra_simulate, gc_log=args.broker_gc_log)
        for i in range(args.repeats)
    ]  # fmt: skip
    for i, run in enumerate(runs):
        print(f"\nrun {i + 1} of {len(runs)}")
        print_table(run)
    result = {
        "benchmark": "freshness",
        "description": __doc__.split("\n\n")[0],
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "loadavg_at_end": os.getloadavg(),
        },
        "settings": {
            "ranks": args.ranks,
            "seconds_per_step": args.duration,
            "rates": rates,
            "sample": f"1 in {args.sample}",
            "settle_s": args.settle,
            "tries": args.tries,
            "try_simulate": args.try_simulate,
        },
        "runs": runs,
        "seconds": round(time.monotonic() - started, 1),
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
