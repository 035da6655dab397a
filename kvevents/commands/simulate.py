"""``kvevents simulate``: simulated engine ranks (under ``mpiexec``) producing KV-cache events to Kafka."""

from __future__ import annotations

import argparse
import json
import os
import signal
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ._common import EXIT_INTERRUPTED, CommandError, Progress, add_kafka_flags, add_output_flags, command

if TYPE_CHECKING:
    from kvevents.producer.simulator.run import RankResult
    from kvevents.producer.simulator.run_config import SimRunConfig

DESCRIPTION = """\
Run simulated inference engines that drive real KVCacheEventManagers, and produce their
KV-cache events to a Kafka topic.

Each process is one attention-DP rank of one engine instance. Under 'mpiexec -n N' the N
processes form --instances instances of --ranks ranks each (N = instances x ranks; the
ranks of an instance gather their events over MPI to their rank 0, which runs the Kafka
sink). Without mpiexec it runs one instance of one rank. Instance k is named
PREFIX-(FIRST+k) (--instance-prefix, --first-instance): give concurrent launches distinct
names. Requests arrive at --rate per second per rank; the run ends after --duration seconds
or --requests requests per rank, or on Ctrl-C (a clean stop: every event already made is
delivered, exit code 130).

--ground-truth FILE: every rank's cache contents at its end, one JSON line per worker
(GroundTruth.to_json()), for 'kvevents index --verify' and the demo.

A rank that dies: run under 'mpiexec -disable-auto-cleanup' and the other ranks go on. Each
rank runs behind a small guard process (what mpiexec sees), so even a SIGKILLed rank looks to
MPICH like a rank that exited; its instance's rank 0 declares it dead after --rank-timeout
seconds of silence, keeps producing the other ranks' events, and reports the loss in-band (a
dropped event of that rank: consumers mark its worker degraded). The summary lists the rank
as failed and the exit status is 1. Without -disable-auto-cleanup MPICH ends the whole job
when any rank dies.
"""

EPILOG = """\
examples:
  kvevents simulate --duration 10 --ground-truth truth.jsonl
  mpiexec -n 8 kvevents simulate --instances 2 --ranks 4 --duration 30 --rate 5
  mpiexec -n 4 kvevents simulate --instance-prefix b --requests 200 --max-kv-event-entries 64 --snapshot-on-drops
  mpiexec -disable-auto-cleanup -n 4 kvevents simulate --duration 60 --rank-timeout 2   # outlives a killed rank

exit status: 0 done; 1 a rank failed, or events were lost without being reported in-band
(consumers could not know; the summary's events_unaccounted_by_rank names any rank whose
flushed events are not all delivered or reported lost); 2 bad arguments; 130 interrupted.
"""


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``simulate``."""
    parser = subparsers.add_parser(
        "simulate",
        help="simulated engine ranks (mpiexec) producing KV-cache events to Kafka",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    run = parser.add_argument_group("run")
    run.add_argument("--instances", type=int, default=1, help="engine instances (default: 1)")
    run.add_argument(
        "--ranks",
        type=int,
        default=None,
        help="attention-DP ranks per instance (default: the MPI world size / --instances)",
    )
    run.add_argument("--instance-prefix", default="sim", help="instance names PREFIX-k (default: sim)")
    run.add_argument(
        "--first-instance", type=int, default=0, help="number of the first instance (default: 0)"
    )
    run.add_argument(
        "--duration", type=float, default=None, metavar="SECONDS", help="wall-clock seconds to run"
    )
    run.add_argument("--requests", type=int, default=None, help="requests per rank, then stop")
    run.add_argument(
        "--rate",
        "--request-rate",
        dest="rate",
        type=float,
        default=10.0,
        help="mean requests per second per rank (default: 10)",
    )
    run.add_argument("--seed", type=int, default=0, help="workload seed (default: 0)")
    run.add_argument("--content-seed", type=int, default=0, help="seed of the shared prompts and documents")
    run.add_argument(
        "--no-realtime",
        dest="realtime",
        action="store_false",
        help="iterate as fast as possible instead of at --iterations-per-second",
    )
    run.add_argument(
        "--max-kv-event-entries",
        type=int,
        default=10_000,
        help="the event manager's buffer per rank (default: 10000)",
    )
    run.add_argument(
        "--snapshot-on-drops",
        action="store_true",
        help="publish a cache snapshot whenever the manager lost events of its rank",
    )
    run.add_argument(
        "--ground-truth",
        type=Path,
        default=None,
        metavar="FILE",
        help="write every worker's final cache contents here (JSON lines)",
    )
    run.add_argument(
        "--rank-timeout",
        type=float,
        default=None,
        metavar="SECONDS",
        help="declare an attention-DP rank dead after this long without a message from it (default: 5)",
    )
    run.add_argument(
        "--no-kafka", action="store_true", help="run without Kafka (events are made and discarded)"
    )
    run.add_argument(
        "--flush-log",
        default=None,
        metavar="DIR",
        help="each rank writes DIR/flush-INSTANCE-RANK.json: per flush, the last event id and "
        "its time.monotonic() (for latency benchmarks)",
    )
    engine = parser.add_argument_group("engine (SimulatorConfig)")
    engine.add_argument("--block-size", type=int, default=32, help="tokens per block (default: 32)")
    engine.add_argument(
        "--num-primary-blocks", type=int, default=1024, help="GPU blocks per rank (default: 1024)"
    )
    engine.add_argument(
        "--num-secondary-blocks",
        type=int,
        default=256,
        help="host blocks per rank for offloading; 0 disables it (default: 256)",
    )
    engine.add_argument(
        "--iterations-per-second", type=float, default=100.0, help="engine iterations per second"
    )
    engine.add_argument(
        "--pace-slack-ms",
        type=float,
        default=1.0,
        help="in real time, sleep only once this far ahead of the schedule: faster iterations run "
        "a few at a time, up to this much early (a sleep per iteration costs more CPU than the "
        "iteration; 0: sleep whenever ahead; default: 1)",
    )
    engine.add_argument(
        "--engine-nice",
        type=int,
        default=0,
        metavar="N",
        help="run each rank's engine thread at nice N (0-19), its manager, gather and sink "
        "threads unchanged: on a machine that hosts the simulation next to the broker and "
        "routers, the pipeline and the rest go first, as if the engines had hosts of their own "
        "(default: 0, unchanged)",
    )
    engine.add_argument("--max-batch-size", type=int, default=64, help="requests running at once at most")
    add_kafka_flags(parser)
    add_output_flags(parser, json_help="print the summary as JSON")
    parser.set_defaults(func=main)


def config_from_args(args: argparse.Namespace, bootstrap: str | None) -> SimRunConfig:
    """The run's configuration (``CommandError`` naming a bad flag)."""
    from kvevents.producer.simulator import SimulatorConfig
    from kvevents.producer.simulator.run_config import SimRunConfig
    from kvevents.producer.simulator.workload import WorkloadConfig

    from ._common import kafka_config, registry_settings

    try:
        simulator = SimulatorConfig(
            block_size=args.block_size,
            num_primary_blocks=args.num_primary_blocks,
            num_secondary_blocks=args.num_secondary_blocks,
            iterations_per_second=args.iterations_per_second,
            pace_slack_s=args.pace_slack_ms / 1000,
            max_batch_size=args.max_batch_size,
        )
        workload = WorkloadConfig(request_rate=args.rate, content_seed=args.content_seed)
        kafka = kafka_config(args)
        if bootstrap is not None:
            kafka.setdefault("bootstrap.servers", bootstrap)
        return SimRunConfig(
            instances=args.instances,
            ranks=args.ranks,
            instance_prefix=args.instance_prefix,
            first_instance=args.first_instance,
            duration_s=args.duration,
            requests=args.requests,
            realtime=args.realtime,
            seed=args.seed,
            max_kv_event_entries=args.max_kv_event_entries,
            snapshot_on_drops=args.snapshot_on_drops,
            rank_timeout_s=args.rank_timeout,
            topic=None if args.no_kafka else args.topic,
            kafka_config=kafka,
            schema_registry=None if args.no_kafka else registry_settings(args),
            flush_log_dir=args.flush_log,
            engine_nice=args.engine_nice,
            simulator=simulator,
            workload=workload,
        )
    except ValueError as exc:
        raise CommandError(str(exc), code=2) from None


@command("simulate")
def main(args: argparse.Namespace) -> int:
    from kvevents.producer.simulator import run as sim_run
    from kvevents.producer.simulator.run_config import mpi_world_size, topology

    from ._common import check_kafka, resolve_bootstrap

    if mpi_world_size() > 1:  # before MPI_Init, before any thread
        from kvevents.producer import tolerate_peer_failures
        from kvevents.producer.rank_guard import guard_rank

        guard_rank(f"kvevents simulate rank {os.environ.get('PMI_RANK', '?')}")
        tolerate_peer_failures()

    bootstrap = None if args.no_kafka else resolve_bootstrap(args)
    config = config_from_args(args, bootstrap)
    if bootstrap is not None:
        check_kafka(args, bootstrap, role="producer")  # the topic may be auto-created by the broker
    try:
        topo = topology(config)
    except ValueError as exc:
        raise CommandError(str(exc), code=2) from None
    show = Progress(enabled=topo.leader and not args.quiet, interval=None)
    rate = _Rate()

    def progress(p: sim_run.Progress) -> None:
        delivered = "" if p.delivered is None else f", delivered {p.delivered}"
        show.update(
            f"{p.seconds:6.1f}s  {topo.instance_id} rank 0: requests {p.requests}, events {p.events} "
            f"({rate(p.seconds, p.events):,.0f}/s), drops {p.drops}{delivered}"
        )

    def on_start(run: sim_run.SimRun) -> None:
        def handler(signum: int, frame: Any) -> None:
            run.stop()
            signal.signal(signum, signal.SIG_DFL)  # a second Ctrl-C kills at once

        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, handler)

    results = sim_run.run(config, topo=topo, on_start=on_start, progress=progress)
    show.done()
    if results is None:  # not world rank 0: rank 0 reports for everybody
        return 0
    if args.ground_truth is not None:
        write_ground_truth(args.ground_truth, results)
    summary = summarize(results, config)
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        print(format_summary(summary, results))
    if summary["failed_ranks"] or summary["events_lost_unreported"] or summary["events_unaccounted_by_rank"]:
        return 1
    return EXIT_INTERRUPTED if summary["interrupted"] else 0


class _Rate:
    """Events per second between two progress calls."""

    def __init__(self) -> None:
        self.last = (0.0, 0)

    def __call__(self, seconds: float, events: int) -> float:
        t0, e0 = self.last
        self.last = (seconds, events)
        return (events - e0) / (seconds - t0) if seconds > t0 else 0.0


def write_ground_truth(path: Path, results: list[RankResult]) -> None:
    """One ``GroundTruth.to_json()`` line per rank that finished (written atomically)."""
    lines = [json.dumps(r.truth, separators=(",", ":")) for r in results if r.truth is not None]
    tmp = path.with_name(path.name + ".tmp")
    try:
        tmp.write_text("".join(line + "\n" for line in lines))
        tmp.replace(path)
    except OSError as exc:
        raise CommandError(f"cannot write the ground truth to {path}: {exc.strerror or exc}") from None


def summarize(results: list[RankResult], config: SimRunConfig) -> dict[str, Any]:
    """The run's figures as JSON: per rank, per instance's Kafka sink, and totals."""
    seconds = max((r.seconds for r in results), default=0.0)
    events = sum(r.events_enqueued for r in results)
    kafka = [r.kafka for r in results if r.kafka is not None]
    # Rank 0's buffer counts its own drops, the other ranks' events it dropped, and the drops
    # the other ranks reported for their own buffers: the instance's total.
    drops = sum(r.manager_drops for r in results if r.attention_dp_rank == 0)
    unaccounted = unaccounted_by_rank(results)
    return {
        "instances": len({r.instance_id for r in results}),
        "ranks": len(results),
        "seconds": round(seconds, 3),
        "topic": config.topic,
        "requests": sum(r.requests_arrived for r in results),
        "events": events,
        "events_per_second": round(events / seconds, 1) if seconds else 0.0,
        "events_delivered": sum(k["events_delivered"] for k in kafka) if kafka else None,
        "bytes_delivered": sum(k["bytes_delivered"] for k in kafka) if kafka else None,
        "messages_delivered": sum(k["messages_delivered"] for k in kafka) if kafka else None,
        "drops": drops,
        "events_lost_unreported": sum(r.events_lost_unreported for r in results),
        "events_unaccounted_by_rank": unaccounted,
        "snapshots": sum(r.snapshots for r in results),
        "failed_ranks": [f"{r.instance_id}/{r.attention_dp_rank}: {r.error}" for r in results if r.error],
        "interrupted": any(r.interrupted for r in results),
        "per_rank": [{k: v for k, v in r.to_json().items() if k != "truth"} for r in results],
    }


def unaccounted_by_rank(results: list[RankResult]) -> dict[str, int]:
    """Per rank (``"instance/rank"``), the events it flushed that its instance's sink neither
    delivered nor reported lost in-band: the end-to-end check of the first rule (must be empty).
    Only for instances whose rank 0 ran a Kafka sink, and ranks that finished (a dead rank's
    count is unknowable; its loss is reported as one dropped event)."""
    sinks = {r.instance_id: r.kafka for r in results if r.kafka is not None and r.attention_dp_rank == 0}
    found: dict[str, int] = {}
    for r in results:
        kafka = sinks.get(r.instance_id)
        if kafka is None or r.error is not None:
            continue
        rank = str(r.attention_dp_rank)
        delivered = kafka["events_delivered_by_rank"].get(rank, 0)
        accounted = delivered + kafka["drops_reported_by_rank"].get(rank, 0)
        if r.events_enqueued != accounted:
            found[f"{r.instance_id}/{rank}"] = r.events_enqueued - accounted
    return found


def format_summary(summary: dict[str, Any], results: list[RankResult]) -> str:
    """A table per rank and a few lines of totals."""
    head = f"{'instance':<12} {'rank':>4} {'requests':>8} {'events':>9} {'blocks':>9} {'drops':>7} {'snaps':>5} {'hit rate':>8}"
    lines = [head]
    for r in results:
        lines.append(
            f"{r.instance_id:<12} {r.attention_dp_rank:>4} {r.requests_arrived:>8} {r.events_enqueued:>9} "
            f"{r.stored_blocks:>9} {r.manager_drops:>7} {r.snapshots:>5} {r.hit_rate:>8.1%}"
            + (f"  ({r.snapshot_failures} snapshots too large for the buffer)" if r.snapshot_failures else "")
            + (f"  FAILED: {r.error}" if r.error else "")
        )
    for r in results:
        if r.kafka is None:
            continue
        k = r.kafka
        lost = sum(k["events_lost_by_reason"].values())
        lines.append(
            f"kafka {r.instance_id}: {k['events_delivered']} events, {k['bytes_delivered']:,} bytes in "
            f"{k['messages_delivered']} messages delivered; sink lost {lost}, "
            f"unreported {sum(k['unreported_by_rank'].values())}"
        )
    delivered = summary["events_delivered"]
    lines.append(
        f"total: {summary['ranks']} ranks of {summary['instances']} instances, {summary['requests']} requests, "
        f"{summary['events']} events in {summary['seconds']:.1f}s ({summary['events_per_second']:,.0f}/s), "
        f"drops {summary['drops']}, snapshots {summary['snapshots']}"
        + ("" if delivered is None else f", delivered {delivered} ({summary['bytes_delivered']:,} bytes)")
    )
    if summary["events_lost_unreported"]:
        lines.append(f"ERROR: {summary['events_lost_unreported']} events lost without an in-band report")
    for worker, missing in summary["events_unaccounted_by_rank"].items():
        lines.append(f"ERROR: {worker}: {missing} events flushed but neither delivered nor reported lost")
    if summary["interrupted"]:
        lines.append("interrupted")
    return "\n".join(lines)
