"""``kvevents demo``: the whole pipeline end to end on this machine (what ``make demo`` runs)."""

from __future__ import annotations

import argparse
import json
import sys

from ._common import CommandError, add_kafka_flags, add_output_flags, command, kafka_config, registry_settings

DESCRIPTION = """\
Run the whole pipeline on this machine and report on it:

  1. Kafka: --bootstrap-servers, else $KAFKA_BOOTSTRAP_SERVERS, else a running local broker,
     else a local broker started for the demo (and stopped at its end);
  2. a fresh topic (or --topic);
  3. --instances concurrent 'mpiexec -n RANKS kvevents simulate' launches: simulated engine
     instances of --ranks attention-DP ranks, for --duration seconds;
  4. a global cache index rebuilt from the topic, checked against the simulators' ground truth;
  5. routing on held-out requests of the same workload: the prefix-cache hit rate when routing
     by the index, against round-robin and random.

Exit status 0 when the index equals the ground truth, 1 when it differs or a step failed,
130 when interrupted (the simulators are stopped cleanly and nothing is left running).
"""

EPILOG = """\
examples:
  kvevents demo
  kvevents demo --duration 10 --json
  kvevents demo --rate 20 --sim-arg=--num-primary-blocks=512
"""


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``demo``."""
    parser = subparsers.add_parser(
        "demo",
        help="the whole pipeline end to end: simulators (mpiexec) -> Kafka -> index, verified, routing",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--duration",
        type=float,
        default=30.0,
        metavar="SECONDS",
        help="how long the simulators run (default: 30)",
    )
    parser.add_argument("--instances", type=int, default=2, help="engine instances (default: 2)")
    parser.add_argument("--ranks", type=int, default=4, help="attention-DP ranks per instance (default: 4)")
    parser.add_argument("--rate", type=float, default=10.0, help="requests per second per rank (default: 10)")
    parser.add_argument("--seed", type=int, default=0, help="workload seed (default: 0)")
    parser.add_argument(
        "--held-out", type=int, default=400, help="held-out requests for routing (default: 400)"
    )
    parser.add_argument(
        "--partitions", type=int, default=2, help="partitions of the fresh topic (default: 2)"
    )
    parser.add_argument(
        "--sim-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="a further 'kvevents simulate' flag (repeatable), e.g. --sim-arg=--block-size=16",
    )
    add_kafka_flags(parser)
    parser.set_defaults(topic=None)
    add_output_flags(parser, json_help="print the report as JSON")
    parser.set_defaults(func=main)


@command("demo")
def main(args: argparse.Namespace) -> int:
    from kvevents.demo import DemoError, DemoOptions, run_demo

    if args.instances < 1 or args.ranks < 1 or args.duration <= 0 or args.held_out < 1:
        raise CommandError("--instances, --ranks and --held-out must be >= 1 and --duration > 0", code=2)

    def say(text: str) -> None:
        if not args.quiet:
            print(text, file=sys.stderr, flush=True)

    options = DemoOptions(
        duration_s=args.duration,
        instances=args.instances,
        ranks=args.ranks,
        rate=args.rate,
        seed=args.seed,
        held_out=args.held_out,
        bootstrap_servers=args.bootstrap_servers,
        topic=args.topic,
        partitions=args.partitions,
        kafka_config=kafka_config(args),
        schema_registry=registry_settings(args),
        simulate_args=tuple(args.sim_arg),
    )
    try:
        report = run_demo(options, say)
    except DemoError as exc:
        raise CommandError(str(exc)) from None
    if args.json:
        print(json.dumps(report.to_json(), indent=2))
    else:
        print(report.describe())
        if not report.ok:
            print(report.verify["text"])
    return 0 if report.ok else 1
