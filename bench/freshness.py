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

All share one machine's clocks: the ranks log ``time.monotonic()`` per flush
(``--flush-log``), the wall-clock stamps are moved onto the monotonic clock with this process's
offset. Messages are decoded after the step, so the measuring consumer does only what a router
does. ``--compare`` runs the settings before this issue's change (:data:`BEFORE_PRODUCER`,
:data:`BEFORE_CONSUMER`) and the current defaults side by side, interleaved per rate, steps
both up to their highest drop-free rate and ends with a flat-out run of each. ``measure()`` is the entry point for ``bench/index.py``.

    python bench/freshness.py                 # current defaults, a few rates (about 1 min)
    python bench/freshness.py --compare       # before vs after, up to the drop-free rate
    python bench/freshness.py --baseline-python ../main/.venv/bin/python --repeats 3
                                              # this checkout's code vs another's, interleaved
"""

from __future__ import annotations

import argparse
import bisect
import json
import os
import platform
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
from kvevents.schemas import decode_batch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import e2e
from e2e import kafka_broker, quantiles

RESULTS = Path(__file__).resolve().parent / "results" / "freshness.json"
STAGES = ("sink", "gather_sink", "produce", "fetch", "apply")
DEFAULT_RATES = (10.0, 160.0, 640.0)
"""Requests/s per rank (4 ranks): 0.6k, 20k and 90k events/s, the last ``bench/e2e.py``'s
highest drop-free step on this machine."""

BEFORE_PRODUCER: dict[str, str] = {"linger.ms": "5", "socket.nagle.disable": "false"}
"""The sink's librdkafka defaults before the freshness change (``docs/OPERATIONS.md``)."""
BEFORE_CONSUMER: dict[str, Any] = {"socket.nagle.disable": False}
"""The reader's librdkafka defaults before the freshness change."""


def wall_minus_monotonic() -> float:
    """``time.time() - time.monotonic()`` (the tightest of a few reads): moves this machine's
    wall-clock stamps onto the monotonic clock every process of it shares."""
    best: tuple[float, float] | None = None
    for _ in range(20):
        a = time.monotonic()
        w = time.time()
        b = time.monotonic()
        if best is None or b - a < best[0]:
            best = (b - a, w - (a + b) / 2)
    assert best is not None
    return best[1]


class Tail(e2e.Tail):
    """Applies every message to an index as it arrives; keeps one in ``sample`` (bytes, append
    time, handed-over and applied times) to decode after the step."""

    def __init__(self, bootstrap: str, topic: str, config: Mapping[str, Any], sample: int) -> None:
        self.samples: list[tuple[bytes, int, float, float]] = []  # value, append ms, handed, applied
        super().__init__(EventReader(bootstrap, topic, config=dict(config)), sample)

    def observe(self, message: Any, value: bytes, handed: float, applied: float) -> None:
        kind, stamp = message.timestamp()
        self.samples.append((value, stamp if kind == TIMESTAMP_LOG_APPEND_TIME else -1, handed, applied))


def stage_latencies(tail: Tail, flush_dir: Path, offset: float) -> dict[str, list[float]]:
    """Per sampled event: the whole path (``e2e``) and each stage, in seconds."""
    flushes: dict[tuple[str, int], tuple[list[int], list[float]]] = {}
    for path in flush_dir.glob("flush-*.json"):
        log = json.loads(path.read_text())
        flushes[(log["instance_id"], log["attention_dp_rank"])] = (
            [f[0] for f in log["flushes"]],
            [f[1] for f in log["flushes"]],
        )
    out: dict[str, list[float]] = {name: [] for name in ("e2e", *STAGES)}
    for value, append_ms, handed, applied in tail.samples:
        batch = decode_batch(value)
        if not batch.events or not batch.created_at_us:
            continue
        created = batch.created_at_us / 1e6 - offset
        appended = append_ms / 1000 - offset if append_ms >= 0 else None
        for event in batch.events:
            found = flushes.get((batch.instance_id, event.attention_dp_rank or 0))
            if found is None:
                continue
            i = bisect.bisect_left(found[0], event.event_id)
            if i == len(found[1]):
                continue
            flushed = found[1][i]
            out["e2e"].append(applied - flushed)
            out["sink" if not event.attention_dp_rank else "gather_sink"].append(created - flushed)
            out["apply"].append(applied - handed)
            if appended is not None:
                out["produce"].append(appended - created)
                out["fetch"].append(handed - appended)
    return out


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
) -> dict[str, Any]:
    """One run of the simulators at ``rate`` requests/s per rank (``realtime=False``: as fast as
    they can, ``--no-realtime``); the step's figures. ``python``: the interpreter of the ranks
    (another checkout's venv runs that checkout's kvevents, with the ``mpiexec`` beside it)."""
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
            for key, value in (producer or {}).items():
                command += ["-X", f"{key}={value}"]
            proc = subprocess.run(command, capture_output=True, text=True, timeout=duration * 4 + 120)
            if proc.returncode != 0:
                raise SystemExit(f"simulate failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
            summary = json.loads(proc.stdout)
            caught_up = tail.wait_for(summary["messages_delivered"] or 0, timeout=60)
        finally:
            tail.close()
        latencies = stage_latencies(tail, work, offset)
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
        "e2e": quantiles(latencies["e2e"]),
        "stages": {name: quantiles(latencies[name]) for name in STAGES},
        "sink_delivery_ack_ms": {
            "p50": None if kafka.get("delivery_p50_s") is None else round(kafka["delivery_p50_s"] * 1000, 2),
            "p99": None if kafka.get("delivery_p99_s") is None else round(kafka["delivery_p99_s"] * 1000, 2),
        },
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
    flat_out: bool = False,
    pythons: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """Freshness at each rate for each variant (name -> (producer -X settings, reader config);
    default: only the current defaults), interleaved per rate. A variant stops stepping after
    its first rate with drops or where the simulators could not keep real time (when
    ``stop_at_drops``, as ``bench/e2e.py`` steps). ``flat_out``: then one run per variant at the
    last rate as fast as the simulators go (the most this machine's pipeline carries). ``pythons``:
    the ranks' interpreter per variant (default this one). Returns ``{"variants": {name: {"steps",
    "highest_drop_free"}}, "kafka", "loadavg"}``."""
    variants = dict(variants or {"defaults": ({}, {})})
    steps: dict[str, list[dict[str, Any]]] = {name: [] for name in variants}
    stopped: set[str] = set()
    load_start = os.getloadavg()
    with kafka_broker(bootstrap) as (servers, kafka):
        if warm_up:
            run_step(servers, rates[0], ranks=ranks, duration=2.0, sample=sample)
        for rate in rates:
            for name, (producer, consumer) in variants.items():
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
                )
                steps[name].append(step)
                print(f"  {name:>8} {rate:g}/s per rank: {summary_line(step)}", file=sys.stderr)
                if stop_at_drops and not sustained(step):
                    stopped.add(name)
        flat: dict[str, dict[str, Any]] = {}
        for name, (producer, consumer) in variants.items() if flat_out else ():
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


def fmt(v: Any, spec: str = ".1f") -> str:
    return "-" if v is None else format(v, spec)


def summary_line(step: Mapping[str, Any]) -> str:
    e = step["e2e"]
    return (
        f"{step['events_per_second']:,.0f} events/s, drops {step['drops']}, pace {step['kept_pace']}, "
        f"e2e p50 {fmt(e['p50_ms'])} p99 {fmt(e['p99_ms'])} ms, load {step['loadavg_1m']:.1f}"
    )


def print_table(result: Mapping[str, Any]) -> None:
    cols = "".join(f" {s + ' p50/p99':>15}" for s in STAGES)
    print(
        f"{'variant':>8} {'rate/rank':>9} {'events/s':>9} {'drops':>6} {'pace':>5} {'kept':>5} "
        f"{'e2e p50':>8} {'e2e p99':>8} {'e2e max':>8}{cols} {'ack p99':>8} {'load':>5}"
    )
    for name, variant in result["variants"].items():
        flat = [variant["flat_out"]] if variant.get("flat_out") else []
        for s in [*variant["steps"], *flat]:
            e = s["e2e"]
            stages = "".join(
                f" {fmt(s['stages'][st]['p50_ms']) + '/' + fmt(s['stages'][st]['p99_ms']):>15}"
                for st in STAGES
            )
            print(
                f"{name:>8} {format(s['rate_per_rank'], 'g') + ('' if s['realtime'] else ' flat'):>9} "
                f"{s['events_per_second']:>9,.0f} {s['drops']:>6} "
                f"{s['pace']:>5.2f} {s['kept_pace']!s:>5} {fmt(e['p50_ms']):>8} {fmt(e['p99_ms']):>8} {fmt(e['max_ms']):>8}"
                f"{stages} {fmt(s['sink_delivery_ack_ms']['p99']):>8} {s['loadavg_1m']:>5.1f}"
            )
    for name, variant in result["variants"].items():
        best = variant["highest_drop_free"]
        if best is None:
            print(f"{name}: no drop-free step")
            continue
        print(
            f"{name}: highest drop-free {best['rate_per_rank']:g}/s per rank = {best['events_per_second']:,.0f} "
            f"events/s (e2e p99 {fmt(best['e2e']['p99_ms'])} ms); worst drop-free p99 "
            f"{fmt(variant['worst_drop_free_p99_ms'])} ms"
        )
        top = variant["highest_sustained"]
        if top is not None:
            print(
                f"{name}: highest sustained (drop-free, engines kept pace) {top['rate_per_rank']:g}/s per "
                f"rank = {top['events_per_second']:,.0f} events/s (e2e p99 {fmt(top['e2e']['p99_ms'])} ms); "
                f"worst sustained p99 {fmt(variant['worst_sustained_p99_ms'])} ms"
            )
        if variant["saturated_steps"]:
            rates = ", ".join(format(r, "g") for r in variant["saturated_steps"])
            print(
                f"{name}: drop-free but saturated (the simulated engines fell behind real time: "
                f"the machine, not the pipeline, set the latency) at {rates}/s per rank"
            )


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
    parser.add_argument("--repeats", type=int, default=1, help="run everything this many times (default 1)")
    parser.add_argument(
        "-b", "--bootstrap-servers", default=None, help="default: $KAFKA_BOOTSTRAP_SERVERS or a local broker"
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
    pythons: dict[str, str] = {}
    if args.baseline_python:
        variants["baseline"] = ({}, {})
        pythons["baseline"] = args.baseline_python
    started = time.monotonic()
    runs = [
        measure(args.bootstrap_servers, rates, ranks=args.ranks, duration=args.duration, sample=args.sample,
                variants=variants, stop_at_drops=args.compare, warm_up=i == 0, flat_out=args.compare,
                pythons=pythons)
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
