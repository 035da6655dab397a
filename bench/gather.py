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

The machine has 2 cores for 4 ranks (and other work): both exchanges share that. MPICH's blocking
calls spin while they wait, which costs more when ranks outnumber cores than it does with one
core per rank.

    python bench/gather.py            # full run
    python bench/gather.py --quick    # smoke run
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib.util
import json
import logging
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from array import array
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from kvevents.producer import find_mpiexec

RESULTS = Path(__file__).resolve().parent / "results" / "gather.json"
RANKS = 4
EVENTS_PER_ITERATION = 50
PROTOCOLS = ("kvevents", "kvevents-py", "lockstep", "none")
TARGETS = {"engine_us_per_iteration": 50.0, "latency_p99_periods": 2.0, "throughput_events_per_s": 200_000}


# ---- worker side (one MPI rank) ------------------------------------------------------------------


def engine_iteration(manager: Any, blocks: list[Any], updates: list[Any], hashes: list[int], i: int) -> None:
    """50 events: 25 Stored (1 block x 32 tokens), 20 Removed (alternating windows: no merge),
    5 Updated; then flush. Arguments are prebuilt: the engine hands over existing objects."""
    stored = manager.enqueue_stored_event
    removed = manager.enqueue_removed_event
    updated = manager.enqueue_updated_event
    base = (i * 25) % len(blocks)
    for k in range(25):
        stored(blocks[base + k], 32)
    for k in range(20):
        removed(hashes[k], 33 + (k & 1))
    for k in range(5):
        updated(updates[k], 32)
    manager.flush()


def run_case(protocol: str, args: argparse.Namespace, world: Any, rank: int, size: int) -> dict[str, Any]:
    from kvevents.producer import BlockInfo, KVCacheEventManager
    from kvevents.producer._recorder import PyRecorder
    from kvevents.schemas import KVCacheEventDiff, KVCacheUpdatedData
    from lockstep import LockstepManager

    class PurePythonManager(KVCacheEventManager):
        _recorder_factory = PyRecorder

    chain = [BlockInfo(1000 + j, 999 + j if j else None, list(range(j, j + 32))) for j in range(2000)]
    blocks = [[b] for b in chain]
    blocks += blocks[:25]
    updates = [KVCacheUpdatedData(7 + k, priority=KVCacheEventDiff(35, 90)) for k in range(5)]
    hashes = [1_000_000 + k for k in range(20)]

    world.Barrier()
    capacity = 2 * args.throughput_events  # no drop by construction (drops are reported anyway)
    if protocol == "lockstep":
        manager = LockstepManager(capacity, rank, size, args.period_ms, drop_warning_interval_s=3600)
    else:  # "none": the same manager without any exchange, the floor of the engine's cost
        gather = protocol != "none"
        manager_class = PurePythonManager if protocol == "kvevents-py" else KVCacheEventManager
        manager = manager_class(
            capacity, rank, size, args.period_ms, drop_warning_interval_s=3600, attention_dp_gather=gather
        )
    exchanging = protocol != "none"
    arrivals: list[tuple[float, int, int, int, int]] = []  # (time, rank, first id, last id, count)
    acks: list[tuple[float, dict[int, int], dict[int, int]]] = []  # (acked at, events, last id) per rank
    stop_reader = threading.Event()
    reader = None
    sink = None
    if rank == 0:
        extend = manager.buffer.extend

        def stamped(events: Any) -> int:
            dropped = extend(events)
            if events:
                first = events[0]
                arrivals.append(
                    (
                        time.monotonic(),
                        first.attention_dp_rank,
                        first.event_id,
                        events[-1].event_id,
                        len(events),
                    )
                )
            return dropped

        manager.buffer.extend = stamped  # type: ignore[method-assign]

        def read() -> None:
            while not stop_reader.is_set():
                manager.drain(timeout=0.05)

        reader = threading.Thread(target=read, daemon=True)
        reader.start()

    def attach_sink() -> None:
        """Rank 0 as deployed: stop the reader, let a Kafka sink drain the manager instead."""
        nonlocal sink, reader
        if reader is not None:
            stop_reader.set()
            reader.join()
            reader = None
        from kvevents.consumer.topics import TopicSpec, create_topic
        from kvevents.producer import KafkaEventSink

        topic = f"bench-gather-{protocol}-{os.getpid()}-{time.monotonic_ns()}"
        create_topic(args.bootstrap, TopicSpec(topic))

        def on_delivery(report: Any) -> None:
            if report.delivered:
                acks.append((report.acked_at, report.events_by_rank, report.last_event_id_by_rank))

        sink = KafkaEventSink(
            manager, topic, "bench", config={"bootstrap.servers": args.bootstrap}, on_delivery=on_delivery
        )

    def wait_delivered(expected_total: int, timeout: float) -> float | None:
        """Rank 0: wait until ``expected_total`` events arrived; the last arrival's time."""
        deadline = time.monotonic() + timeout
        while sum(a[4] for a in arrivals) < expected_total:
            if time.monotonic() > deadline:
                return None
            time.sleep(0.002)
        return arrivals[-1][0] if arrivals else None

    def wait_acked(expected_total: int, timeout: float) -> float | None:
        """Rank 0 with a sink: wait until Kafka acknowledged ``expected_total`` events."""
        deadline = time.monotonic() + timeout
        while sum(sum(a[1].values()) for a in list(acks)) < expected_total:
            if time.monotonic() > deadline:
                return None
            time.sleep(0.005)
        return max(a[0] for a in acks) if acks else None

    steady: dict[str, dict[str, Any]] = {}
    iteration = 0

    def steady_phase(label: str, gap_ms: float) -> None:
        nonlocal iteration
        world.Barrier()
        costs_ns = array("q")
        starts = array("d")
        first_id = iteration * EVENTS_PER_ITERATION
        cpu0, wall0 = time.process_time(), time.monotonic()
        for _ in range(args.iterations):
            t_start = time.monotonic()
            p0 = time.perf_counter_ns()
            engine_iteration(manager, blocks, updates, hashes, iteration)
            costs_ns.append(time.perf_counter_ns() - p0)
            starts.append(t_start)
            iteration += 1
            time.sleep(gap_ms / 1000)
        cpu = (time.process_time() - cpu0) / (time.monotonic() - wall0)
        total = world.allreduce(args.iterations * EVENTS_PER_ITERATION)
        complete = wait_delivered(total, 30) is not None if rank == 0 and exchanging else True
        acked = wait_acked(total, 60) is not None if sink is not None else None
        steady[label] = {
            "engine_costs_ns": list(costs_ns),
            "iteration_starts": list(starts),
            "first_event_id": first_id,
            "cpu": cpu,
            "arrivals": list(arrivals),
            "complete": complete,
            "acks": [
                (t, {str(r): n for r, n in by.items()}, {str(r): i for r, i in last.items()})
                for t, by, last in acks
            ],
            "acked_complete": acked,
        }
        arrivals.clear()
        acks.clear()

    # -- steady, rank 0 drained by a reader: the gather alone ------------------------------------
    for gap_ms in args.gaps_ms:
        steady_phase(f"{gap_ms:g}", gap_ms)

    # -- idle ----------------------------------------------------------------------------------
    world.Barrier()
    time.sleep(1.2)  # the manager's worker parks after 1 s without work
    cpu0, wall0 = time.process_time(), time.monotonic()
    time.sleep(args.idle_s)
    idle_cpu = (time.process_time() - cpu0) / (time.monotonic() - wall0)

    # -- with Kafka: rank 0's manager drained by the sink, the broker on the same cores -------------
    if rank == 0 and exchanging and args.bootstrap:
        attach_sink()
    if args.bootstrap:
        steady_phase(f"{args.gaps_ms[0]:g}+kafka", args.gaps_ms[0])

    # -- throughput ------------------------------------------------------------------------------
    world.Barrier()
    t0 = time.monotonic()
    n_iterations = args.throughput_events // EVENTS_PER_ITERATION if exchanging else 0
    interval = EVENTS_PER_ITERATION / (args.offered_rate / size)  # this rank's share of the load
    for i in range(n_iterations):
        delay = t0 + i * interval - time.monotonic()
        if delay > 0:
            time.sleep(delay)  # on schedule; behind it, no sleep (the load is offered, not adapted)
        engine_iteration(manager, blocks, updates, hashes, iteration)
        iteration += 1
    produced_s = time.monotonic() - t0
    total = world.allreduce(n_iterations * EVENTS_PER_ITERATION)
    last = wait_delivered(total, 120) if rank == 0 and exchanging else None
    delivered = sum(a[4] for a in arrivals)
    last_ack = wait_acked(total, 120) if sink is not None else None
    kafka_acked = sum(sum(a[1].values()) for a in acks)

    world.Barrier()
    stop_reader.set()
    if reader is not None:
        reader.join()
    manager.close()
    sink_stats = None
    if sink is not None:
        sink.close(timeout=60)
        sink_stats = sink.stats()
    stats = manager.stats().buffer
    result: dict[str, Any] = {
        "protocol": protocol,
        "rank": rank,
        "steady": steady,
        "idle_cpu": idle_cpu,
        "throughput_produced_s": produced_s,
        "dropped_total": stats.events_dropped_total,
    }
    if rank == 0:
        result.update(
            throughput_events=delivered,
            throughput_expected=total,
            throughput_s=(last - t0) if last is not None else None,
            kafka_acked=kafka_acked if sink is not None else None,
            kafka_s=(last_ack - t0) if last_ack is not None else None,
            sink_events_lost=dict(sink_stats.events_lost_by_rank) if sink_stats is not None else None,
        )
        if protocol.startswith("kvevents"):
            gather = manager.gather
            assert gather is not None
            result["gather_stats"] = dataclasses.asdict(gather.stats())
    return result


def worker(args: argparse.Namespace) -> None:
    rank = int(os.environ.get("PMI_RANK", "0"))
    logging.basicConfig(level=logging.WARNING)
    sys.path.insert(0, str(Path(__file__).resolve().parent / "support"))
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    size = world.Get_size()
    if args.bootstrap:
        # Warm the broker (JIT, coordinator, page cache) so that the first measured case is not
        # charged for it; discarded.
        warm = argparse.Namespace(**{**vars(args), "iterations": 200, "gaps_ms": [1.0], "throughput_events": 20_000,
                                      "idle_s": 0.1})  # fmt: skip
        run_case("kvevents", warm, world, rank, size)
    cases = []
    for repeat in range(args.repeats):
        # Rotated: over len(protocols) repeats each protocol runs once in every position (the
        # first case of a repeat measured slower, whichever protocol it was).
        shift = repeat % len(args.protocols)
        order = [*args.protocols[shift:], *args.protocols[:shift]]
        for protocol in order:
            case = run_case(protocol, args, world, rank, size)
            case["repeat"] = repeat
            cases.append(case)
    (args.out / f"rank{rank}.json").write_text(json.dumps(cases))


# ---- launcher side ------------------------------------------------------------------------------


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    k = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[k]


def latencies_ms(phase: str, ranks: dict[int, dict[str, Any]]) -> list[float]:
    """Per event of ranks != 0: arrival in rank 0's buffer minus its iteration's start."""
    out = []
    for t, source, first, last, _ in ranks[0]["steady"][phase]["arrivals"]:
        if source == 0:
            continue
        own = ranks[source]["steady"][phase]
        starts, base = own["iteration_starts"], own["first_event_id"]
        for event_id in range(first, last + 1):
            out.append((t - starts[(event_id - base) // EVENTS_PER_ITERATION]) * 1000)
    return out


def kafka_latencies_ms(phase: str, ranks: dict[int, dict[str, Any]]) -> list[float]:
    """Per event of ranks != 0: Kafka's acknowledgement minus its iteration's start (a message
    holds a contiguous run of each rank's ids ending at ``last_event_id_by_rank``)."""
    out = []
    for t, by_rank, last_ids in ranks[0]["steady"][phase]["acks"]:
        for source, count in by_rank.items():
            if source == "0":
                continue
            own = ranks[int(source)]["steady"][phase]
            starts, base = own["iteration_starts"], own["first_event_id"]
            last = last_ids[source]
            for event_id in range(last - count + 1, last + 1):
                out.append((t - starts[(event_id - base) // EVENTS_PER_ITERATION]) * 1000)
    return out


def summarize(cases_by_rank: dict[int, list[dict[str, Any]]], args: argparse.Namespace) -> dict[str, Any]:
    per_protocol: dict[str, list[dict[str, Any]]] = {p: [] for p in args.protocols}
    for index, root in enumerate(cases_by_rank[0]):
        ranks = {r: cases_by_rank[r][index] for r in cases_by_rank}
        phases = {}
        for phase in root["steady"]:
            costs = [
                ns / 1000 for r in ranks if r != 0 for ns in ranks[r]["steady"][phase]["engine_costs_ns"]
            ]
            lat = latencies_ms(phase, ranks)
            kafka_lat = kafka_latencies_ms(phase, ranks)
            phases[phase] = {
                "kafka_latency_ms_p50": percentile(kafka_lat, 50),
                "kafka_latency_ms_p99": percentile(kafka_lat, 99),
                "kafka_latency_events": len(kafka_lat),
                "engine_us_p50": percentile(costs, 50),
                "engine_us_mean": statistics.fmean(costs),
                "engine_us_p99": percentile(costs, 99),
                "latency_ms_p50": percentile(lat, 50),
                "latency_ms_p99": percentile(lat, 99),
                "latency_ms_max": max(lat) if lat else float("nan"),
                "latency_events": len(lat),
                "complete": root["steady"][phase]["complete"],
                "cpu_percent": {str(r): round(100 * ranks[r]["steady"][phase]["cpu"], 1) for r in ranks},
            }
        rate = root["throughput_events"] / root["throughput_s"] if root["throughput_s"] else 0.0
        kafka_rate = root["kafka_acked"] / root["kafka_s"] if root.get("kafka_s") else 0.0
        per_protocol[root["protocol"]].append(
            {
                "repeat": root["repeat"],
                "steady": phases,
                "throughput_events_per_s": rate,
                "kafka_events_per_s": kafka_rate,
                "kafka_acked": root.get("kafka_acked"),
                "sink_events_lost": root.get("sink_events_lost"),
                "throughput_events": root["throughput_events"],
                "throughput_expected": root["throughput_expected"],
                "produce_s_max": max(ranks[r]["throughput_produced_s"] for r in ranks),
                "idle_cpu_percent": {str(r): round(100 * ranks[r]["idle_cpu"], 2) for r in ranks},
                "dropped": {str(r): ranks[r]["dropped_total"] for r in ranks},
                **({"gather_stats_rank0": root["gather_stats"]} if "gather_stats" in root else {}),
            }
        )
    med = statistics.median
    summary: dict[str, Any] = {}
    for protocol, runs in per_protocol.items():
        entry: dict[str, Any] = {"repeats": runs}
        for phase in runs[0]["steady"]:
            for key in (
                "engine_us_p50", "engine_us_mean", "engine_us_p99", "latency_ms_p50", "latency_ms_p99",
                "kafka_latency_ms_p50", "kafka_latency_ms_p99",
            ):  # fmt: skip
                entry[f"gap{phase}_{key}"] = med(r["steady"][phase][key] for r in runs)
            entry[f"gap{phase}_cpu_percent_total"] = med(
                sum(r["steady"][phase]["cpu_percent"].values()) for r in runs
            )
        entry["throughput_events_per_s"] = med(r["throughput_events_per_s"] for r in runs)
        entry["throughput_events_per_s_best"] = max(r["throughput_events_per_s"] for r in runs)
        entry["kafka_events_per_s"] = med(r["kafka_events_per_s"] for r in runs)
        entry["kafka_events_per_s_best"] = max(r["kafka_events_per_s"] for r in runs)
        entry["idle_cpu_percent_total"] = med(sum(r["idle_cpu_percent"].values()) for r in runs)
        summary[protocol] = entry
    return summary


def phase_name(label: str) -> str:
    gap, _, kafka = label.partition("+")
    return f"[{gap} ms gap{', Kafka sink' if kafka else ''}]"


def table_rows(phases: list[str], period_ms: float) -> list[tuple[str, str, str, str]]:
    """(key, label, format, target) of each printed row."""
    rows = []
    for phase in phases:
        name = phase_name(phase)
        rows += [
            (f"gap{phase}_engine_us_p50", f"{name} engine us/iteration p50", "{:.1f}", "<= 50"),
            (f"gap{phase}_engine_us_p99", f"{name} engine us/iteration p99", "{:.1f}", ""),
            (f"gap{phase}_latency_ms_p50", f"{name} gather latency ms p50", "{:.2f}", ""),
            (
                f"gap{phase}_latency_ms_p99",
                f"{name} gather latency ms p99",
                "{:.2f}",
                f"<= {2 * period_ms:g}",
            ),
        ]
        if "kafka" in phase:
            rows += [
                (f"gap{phase}_kafka_latency_ms_p50", f"{name} enqueue->Kafka ack ms p50", "{:.2f}", ""),
                (f"gap{phase}_kafka_latency_ms_p99", f"{name} enqueue->Kafka ack ms p99", "{:.2f}", ""),
            ]
        rows.append((f"gap{phase}_cpu_percent_total", f"{name} CPU % of the 4 ranks", "{:.0f}", ""))
    rows += [
        ("kafka_events_per_s", "events/s into Kafka (4 ranks), median", "{:,.0f}", ">= 200,000"),
        ("kafka_events_per_s_best", "events/s into Kafka, best", "{:,.0f}", ""),
        ("throughput_events_per_s", "events/s into rank 0's buffer, median", "{:,.0f}", ""),
        ("throughput_events_per_s_best", "events/s into rank 0's buffer, best", "{:,.0f}", ""),
        ("idle_cpu_percent_total", "idle CPU % of the 4 ranks", "{:.2f}", ""),
    ]
    return rows


def print_table(summary: dict[str, Any], gaps: list[str], period_ms: float) -> None:
    k = summary["kvevents"]
    py, b, n = (summary.get(p, {}) for p in ("kvevents-py", "lockstep", "none"))

    def cell(fmt: str, value: float, label: str) -> str:
        return "-" if value != value or (value == 0 and "events/s" in label) else fmt.format(value)

    print(
        f"\n{'metric (median of repeats)':52} {'kvevents':>11} {'kv pure-py':>11} {'py/kv':>7} {'lockstep':>11} "
        f"{'lockstep/kv':>11} {'no exchange':>11} {'target':>11}"
    )
    nan = float("nan")
    for key, label, fmt, target in table_rows(gaps, period_ms):
        base = k[key]
        ratio = b.get(key, nan) / base if base else nan
        py_ratio = py.get(key, nan) / base if base else nan
        none = n.get(key, nan) if "events/s" not in label else nan
        print(
            f"{label:52} {cell(fmt, base, label):>11} {cell(fmt, py.get(key, nan), label):>11} {py_ratio:>7.2f} "
            f"{cell(fmt, b.get(key, nan), label):>11} {ratio:>11.2f} {cell(fmt, none, label):>11} {target:>11}"
        )


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
