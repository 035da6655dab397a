"""End-to-end pipeline benchmark: simulated engine ranks under mpiexec -> Kafka -> a live index.

``python bench/e2e.py`` steps the request rate up across short runs of
``mpiexec -n RANKS kvevents simulate`` (one instance of RANKS attention-DP ranks, default sizes:
10,000-entry event buffers, 1024 + 256 blocks per rank) while this process tails the topic with
an :class:`~kvevents.consumer.EventReader` and applies every batch to a
:class:`~kvevents.consumer.CacheIndex`. Each step offers RATE requests/s per rank to an engine iterating
``max(100, 10 * RATE)`` times a second (so its serving capacity grows with the rate). Per
step it reports the events/s the ranks produced,
what Kafka delivered, drops, whether the simulators kept their real-time pace, whether the
index equals the ground truth at the end, and the end-to-end latency of every event:

- ``e2e``: from the engine's ``flush()`` of the iteration that enqueued the event (each rank
  logs ``time.monotonic()`` per flush with the last event id it handed over:
  ``kvevents simulate --flush-log``; an event is enqueued at most one engine iteration, 10 ms,
  before that flush) to the moment its batch was applied to the index in this process
  (``time.monotonic()``; CLOCK_MONOTONIC is shared by the processes of one machine), over the
  events of one message in 4 (the index applies every message with ``apply_encoded``; only the
  sampled ones are also decoded, for their event ids);
- ``envelope``: from the batch's ``created_at_us`` (the sink's wall clock when it built the
  batch) to applied, i.e. the Kafka and consumer part alone.

The steps stop at the first rate with drops (or a simulator that can no longer keep pace);
the highest drop-free step is the headline. A last run goes flat out (``--no-realtime``, same duration): the
simulators iterate as fast as they can (the engine's simulated clock races ahead of the wall
clock), which shows the most this machine's simulators and pipeline do together.

    python bench/e2e.py            # full run (about 2 minutes)
    python bench/e2e.py --quick    # smoke run
"""

from __future__ import annotations

import argparse
import bisect
import contextlib
import json
import os
import platform
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from kvevents.consumer import CacheIndex, EventReader
from kvevents.consumer.topics import TopicSpec, create_topic
from kvevents.producer import find_mpiexec
from kvevents.schemas import decode_batch

from kvevents.verify import compare, load_ground_truth

RESULTS = Path(__file__).resolve().parent / "results" / "e2e.json"


@contextlib.contextmanager
def kafka_broker(bootstrap: str | None = None) -> Iterator[tuple[str, str]]:
    """``bootstrap``, else ``KAFKA_BOOTSTRAP_SERVERS``, else a local broker for the run (stopped
    at the end); yields (servers, where they came from). Every bench that needs Kafka uses it."""
    with kafka_broker_and_gc_log(bootstrap) as (servers, where, _):
        yield servers, where


@contextlib.contextmanager
def kafka_broker_and_gc_log(bootstrap: str | None = None) -> Iterator[tuple[str, str, Path | None]]:
    """``kafka_broker``, and the GC log of the broker when this run started it (else None). A
    broker started here is settled first (``settle_broker``; ``BENCH_BROKER_SETTLE=0`` skips it)."""
    if bootstrap:
        yield bootstrap, bootstrap, None
        return
    if os.environ.get("KAFKA_BOOTSTRAP_SERVERS"):
        yield os.environ["KAFKA_BOOTSTRAP_SERVERS"], "KAFKA_BOOTSTRAP_SERVERS", None
        return
    from kvevents.broker import LocalBroker

    with tempfile.TemporaryDirectory(prefix="bench-broker-") as state:
        broker = LocalBroker(Path(state) / "state", stop_with_parent=True)
        status = broker.start()
        if os.environ.get("BENCH_BROKER_SETTLE", "1") != "0" and status.pid is not None:
            settle_broker(status.pid)
        try:
            yield broker.bootstrap_servers, "local broker (kvevents.broker defaults)", broker.gc_log
        finally:
            broker.stop()


def settle_broker(pid: int) -> None:
    """A full collection of a freshly started broker's heap (``jcmd PID GC.run``, when the JDK has
    jcmd), so that what its start left alive is not copied by the first young collections inside
    a measured step: a long-running broker has long moved it to the old generation. Measured
    (docs/OPERATIONS.md): the longest pause in 160-320 requests/s steps 45 ms, against 166 ms."""
    from kvevents.broker import find_java
    from kvevents.broker.gclog import request_full_gc

    request_full_gc(pid, find_java())


def mpiexec() -> str:
    found = find_mpiexec()
    if not found:
        raise SystemExit("mpiexec not found: pip install -e '.[dev]'")
    return found


class Tail:
    """Applies the topic's messages to an index as they arrive (``apply_encoded``, the fast path a
    router uses) and, for one message in ``sample``, decodes it to note when each of its events
    was applied (decoding every message in Python would make the measuring consumer the
    bottleneck). Subclasses keep other samples by overriding :meth:`observe`."""

    def __init__(self, reader: EventReader, sample: int) -> None:
        self.reader = reader
        self.index = CacheIndex()
        self.sample = sample
        self.applied: dict[tuple[str, int], list[tuple[int, float]]] = defaultdict(list)
        self.envelope: list[tuple[float, int]] = []  # (seconds from created_at_us to applied, events)
        self.messages = 0
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        apply = self.index.apply_encoded
        monotonic = time.monotonic
        while not self._stop.is_set():
            for message in self.reader.messages(until_caught_up=False, timeout=0.2):
                handed = monotonic()
                value = message.value()
                apply(value)
                applied = monotonic()
                self.messages += 1
                if self.messages % self.sample == 0:
                    self.observe(message, value, handed, applied)

    def observe(self, message: Any, value: bytes, handed: float, applied: float) -> None:
        """One sampled message, applied at ``applied`` (monotonic): when each event was applied."""
        wall = time.time()
        batch = decode_batch(value)
        if batch.created_at_us and batch.events:
            self.envelope.append((wall - batch.created_at_us / 1e6, len(batch.events)))
        for event in batch.events:
            self.applied[(batch.instance_id, event.attention_dp_rank or 0)].append((event.event_id, applied))

    def wait_for(self, messages: int, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while self.messages < messages and time.monotonic() < deadline:
            time.sleep(0.05)
        return self.messages >= messages

    def close(self) -> None:
        self._stop.set()
        self.reader.stop()
        self.thread.join(30)
        self.reader.close()


def quantiles(values: list[float], weights: list[int] | None = None) -> dict[str, float | None]:
    if not values:
        return {"p50_ms": None, "p99_ms": None, "max_ms": None}
    if weights is None:
        ordered = sorted(values)
    else:
        ordered = sorted(v for v, w in zip(values, weights, strict=True) for _ in range(w))
    n = len(ordered)
    return {
        "p50_ms": round(ordered[n // 2] * 1000, 2),
        "p99_ms": round(ordered[min(n - 1, int(n * 0.99))] * 1000, 2),
        "max_ms": round(ordered[-1] * 1000, 2),
    }


def e2e_latencies(tail: Tail, flush_dir: Path) -> list[float]:
    """Per applied event: applied time - the time of the flush that handed it over."""
    out: list[float] = []
    for path in flush_dir.glob("flush-*.json"):
        log = json.loads(path.read_text())
        key = (log["instance_id"], log["attention_dp_rank"])
        last_ids = [f[0] for f in log["flushes"]]
        times = [f[1] for f in log["flushes"]]
        for event_id, applied in tail.applied.get(key, ()):
            i = bisect.bisect_left(last_ids, event_id)
            if i < len(times):
                out.append(applied - times[i])
    return out


def engine_speed(rate: float) -> float:
    """Iterations per second for a request rate: 10 per request/s, at least the default 100, so
    that the simulated engine's serving capacity (64 running requests, one token per iteration)
    grows with the offered rate instead of capping the events it makes."""
    return max(100.0, 10.0 * rate)


def run_step(
    bootstrap: str,
    ranks: int,
    rate: float,
    duration: float,
    realtime: bool = True,
    requests: int | None = None,
    poll_timeout_s: float = 0.2,
    sample: int = 4,
) -> dict[str, Any]:
    topic = f"bench-e2e-{uuid.uuid4().hex[:10]}"
    create_topic(bootstrap, TopicSpec(topic))
    with tempfile.TemporaryDirectory(prefix="bench-e2e-") as tmp:
        work = Path(tmp)
        tail = Tail(EventReader(bootstrap, topic, poll_timeout_s=poll_timeout_s), sample)
        try:
            command = [
                mpiexec(),
                "-n",
                str(ranks),
                sys.executable,
                "-m",
                "kvevents.cli",
                "simulate",
                "--rate",
                str(rate),
                "-b",
                bootstrap,
                "--topic",
                topic,
                "--json",
                "-q",
                "--ground-truth",
                str(work / "truth.jsonl"),
                "--flush-log",
                str(work),
                "--iterations-per-second",
                str(engine_speed(rate)),
            ]
            command += ["--duration", str(duration)] if requests is None else ["--requests", str(requests)]
            if not realtime:
                command.append("--no-realtime")
            proc = subprocess.run(command, capture_output=True, text=True, timeout=duration * 4 + 120)
            if proc.returncode != 0:
                raise SystemExit(f"simulate failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
            summary = json.loads(proc.stdout)
            caught_up = tail.wait_for(summary["messages_delivered"] or 0, timeout=60)
        finally:
            tail.close()
        report = compare(tail.index, load_ground_truth(work / "truth.jsonl"))
        latencies = e2e_latencies(tail, work)
        envelope = quantiles([v for v, _ in tail.envelope], [w for _, w in tail.envelope])
    expected_iterations = duration * engine_speed(rate) if realtime and requests is None else None
    per_rank = summary["per_rank"]
    kept_pace = (
        expected_iterations is None or min(r["iterations"] for r in per_rank) >= 0.9 * expected_iterations
    )
    return {
        "rate_per_rank": rate,
        "iterations_per_second": engine_speed(rate),
        "realtime": realtime,
        "ranks": ranks,
        "reader_poll_timeout_s": poll_timeout_s,
        "seconds": summary["seconds"],
        "requests": summary["requests"],
        "events": summary["events"],
        "events_per_second": summary["events_per_second"],
        "events_delivered": summary["events_delivered"],
        "bytes_delivered": summary["bytes_delivered"],
        "drops": summary["drops"],
        "events_lost_unreported": summary["events_lost_unreported"],
        "kept_pace": kept_pace,
        "min_iterations": min(r["iterations"] for r in per_rank),
        "index_caught_up": caught_up,
        "index_equals_truth": report.ok,
        "e2e_latency": quantiles(latencies)
        | {"events_sampled": len(latencies), "messages_sampled": f"1 in {sample}"},
        "envelope_latency": envelope,
    }


def drop_free_steps(
    bootstrap: str, ranks: int, rates: list[float], duration: float, label: str, **step: Any
) -> tuple[list[dict[str, Any]], dict[str, Any] | None]:
    """``run_step`` per rate, rising, until a step drops, loses events or falls behind real time;
    the steps, and the highest clean one (no drops, none lost, index equal to the truth)."""
    steps: list[dict[str, Any]] = []
    for rate in rates:
        result = run_step(bootstrap, ranks, rate, duration, **step)
        steps.append(result)
        print(
            f"  {label} {rate:g}/s per rank: {result['events_per_second']:,.0f} events/s, drops {result['drops']}, "
            f"kept pace {result['kept_pace']}, equal {result['index_equals_truth']}",
            file=sys.stderr,
        )
        if result["drops"] or result["events_lost_unreported"] or not result["kept_pace"]:
            break
    clean = [
        s for s in steps if not s["drops"] and not s["events_lost_unreported"] and s["index_equals_truth"]
    ]
    return steps, max(clean, key=lambda s: s["events_per_second"], default=None)


def fmt(v: Any, spec: str = "") -> str:
    return "-" if v is None else format(v, spec)


def print_table(steps: list[dict[str, Any]]) -> None:
    head = (
        f"{'rate/rank':>9} {'iter/s':>6} {'mode':>8} {'requests':>8} {'events':>8} {'events/s':>9} {'drops':>6} "
        f"{'pace':>5} {'equal':>5} {'e2e p50':>8} {'e2e p99':>8} {'env p50':>8} {'env p99':>8}"
    )
    print(head)
    for s in steps:
        e, v = s["e2e_latency"], s["envelope_latency"]
        print(
            f"{s['rate_per_rank']:>9g} {s['iterations_per_second']:>6g} {'realtime' if s['realtime'] else 'flat-out':>8} {s['requests']:>8} "
            f"{s['events']:>8} {s['events_per_second']:>9,.0f} {s['drops']:>6} {s['kept_pace']!s:>5} "
            f"{s['index_equals_truth']!s:>5} {fmt(e['p50_ms'], '.1f'):>8} {fmt(e['p99_ms'], '.1f'):>8} "
            f"{fmt(v['p50_ms'], '.1f'):>8} {fmt(v['p99_ms'], '.1f'):>8}"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="short steps, fewer rates")
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--duration", type=float, default=None, help="seconds per step (default 8; quick 3)")
    parser.add_argument("--rates", default=None, help="comma-separated requests/s per rank to step through")
    parser.add_argument(
        "--poll-timeout",
        type=float,
        default=0.2,
        help="EventReader poll_timeout_s of the tailing index (default 0.2, the reader's: it "
        "hands over each message as it arrives, the timeout only bounds an idle wait)",
    )
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    duration = args.duration or (3.0 if args.quick else 8.0)
    rates = (
        [float(r) for r in args.rates.split(",")]
        if args.rates
        else ([10, 40, 160] if args.quick else [10, 20, 40, 80, 160, 320, 640, 1280])
    )
    started = time.monotonic()
    with kafka_broker() as (bootstrap, kafka):
        run_step(bootstrap, args.ranks, rates[0], 2.0)  # warm-up (broker JIT, page cache): discarded
        steps, best = drop_free_steps(
            bootstrap, args.ranks, rates, duration, "step", poll_timeout_s=args.poll_timeout
        )
        flat = run_step(
            bootstrap, args.ranks, rates[-1], duration, realtime=False, poll_timeout_s=args.poll_timeout
        )
    print()
    print_table([*steps, flat])
    if best is not None:
        e = best["e2e_latency"]
        print(
            f"\nhighest drop-free step: {best['rate_per_rank']:g} requests/s per rank x {best['ranks']} ranks = "
            f"{best['events_per_second']:,.0f} events/s; e2e latency p50 {fmt(e['p50_ms'])} ms, "
            f"p99 {fmt(e['p99_ms'])} ms (flush on the rank -> applied in the index)"
            + (
                ""
                if best["kept_pace"]
                else "; the simulators fell behind real time there: that is all they "
                "could make on this machine"
            )
        )
    result = {
        "benchmark": "e2e",
        "description": __doc__.split("\n\n")[0],
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "loadavg_at_end": os.getloadavg(),
            "kafka": kafka,
        },
        "settings": {
            "ranks": args.ranks,
            "instances": 1,
            "seconds_per_step": duration,
            "rates": rates,
            "reader_poll_timeout_s": args.poll_timeout,
            "latency": "e2e: time.monotonic() of the rank's flush() of the event's iteration -> batch "
            "applied to the index; envelope: batch created_at_us (sink wall clock) -> applied",
        },
        "steps": steps,
        "flat_out": flat,
        "highest_drop_free": best,
        "seconds": round(time.monotonic() - started, 1),
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
