"""``kvevents topic create|describe``: Kafka topics with the settings kvevents cares about."""

from __future__ import annotations

import argparse
import json
import sys

from kvevents.commands._common import (
    BOOTSTRAP_HELP,
    CommandError,
    add_client_config_flags,
    check_kafka,
    config_pair,
    kafka_config,
    quiet_librdkafka,
    resolve_bootstrap,
)

DESCRIPTION = """\
Create or describe a Kafka topic.

The broker is --bootstrap-servers, else bootstrap.servers of -F/-X, else $KAFKA_BOOTSTRAP_SERVERS,
else the local broker that 'kvevents broker start' runs (see 'kvevents broker --help').
"""

EPILOG = """\
examples:
  kvevents topic create kv-cache-events --partitions 8 --retention-ms 3600000 --max-message-bytes 4194304
  kvevents topic create kv-cache-snapshots --cleanup-policy compact
  kvevents topic describe kv-cache-events --json
"""


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``topic`` and its sub-commands."""
    parser = subparsers.add_parser(
        "topic",
        help="create or describe a Kafka topic",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    actions = parser.add_subparsers(dest="topic_command", metavar="ACTION", required=True)

    def add(name: str, help_text: str) -> argparse.ArgumentParser:
        sub = actions.add_parser(name, help=help_text, description=help_text)
        sub.add_argument("name", help="topic name")
        sub.add_argument(
            "--bootstrap-servers",
            "-b",
            default=None,
            help=BOOTSTRAP_HELP,
        )
        sub.add_argument(
            "--timeout", type=float, default=30.0, help="seconds to wait for the broker (default: 30)"
        )
        add_client_config_flags(sub)
        return sub

    create = add(
        "create",
        "create a topic; succeeds without change when it exists with the same settings, "
        "fails naming the differences when its settings differ",
    )
    create.add_argument("--partitions", "-p", type=int, default=1, help="number of partitions (default: 1)")
    create.add_argument(
        "--replication-factor", type=int, default=1, help="replicas per partition (default: 1)"
    )
    create.add_argument("--retention-ms", type=int, default=None, help="retention.ms; -1 keeps data forever")
    create.add_argument(
        "--max-message-bytes", type=int, default=None, help="max.message.bytes: largest record batch"
    )
    create.add_argument(
        "--cleanup-policy",
        choices=["delete", "compact", "compact,delete"],
        default=None,
        help="cleanup.policy",
    )
    create.add_argument(
        "--config", "-c", type=config_pair, action="append", default=[], metavar="KEY=VALUE",
        help="any other topic config (repeatable)",
    )  # fmt: skip
    create.set_defaults(func=_create)

    describe = add("describe", "partitions, leaders, watermarks and configs of a topic")
    describe.add_argument("--json", action="store_true", help="print JSON (every config included)")
    describe.set_defaults(func=_describe)


def _bootstrap(args: argparse.Namespace) -> str | None:
    """The broker's address once it answered (None after printing why not)."""
    quiet_librdkafka(args)
    try:
        bootstrap = resolve_bootstrap(args)
        check_kafka(args, bootstrap, role="producer")
        return bootstrap
    except CommandError as exc:
        print(f"kvevents topic {args.topic_command}: {exc}", file=sys.stderr)
        return None


def _create(args: argparse.Namespace) -> int:
    from kvevents.consumer.topics import TopicError, TopicSpec, create_topic

    try:
        spec = TopicSpec(
            args.name,
            partitions=args.partitions,
            replication_factor=args.replication_factor,
            retention_ms=args.retention_ms,
            max_message_bytes=args.max_message_bytes,
            cleanup_policy=args.cleanup_policy,
            configs=dict(args.config),
        )
    except ValueError as exc:
        print(f"kvevents topic create: {exc}", file=sys.stderr)
        return 2
    bootstrap = _bootstrap(args)
    if bootstrap is None:
        return 1
    try:
        created = create_topic(bootstrap, spec, timeout=args.timeout, config=kafka_config(args))
    except TopicError as exc:
        print(f"kvevents topic create: {exc}", file=sys.stderr)
        return 1
    what = "created" if created else "already exists with these settings"
    print(f"topic {spec.name!r} {what} on {bootstrap}")
    return 0


def _describe(args: argparse.Namespace) -> int:
    from kvevents.consumer.topics import TopicError, describe_topic

    bootstrap = _bootstrap(args)
    if bootstrap is None:
        return 1
    try:
        topic = describe_topic(bootstrap, args.name, timeout=args.timeout, config=kafka_config(args))
    except TopicError as exc:
        print(f"kvevents topic describe: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(topic.to_dict(), indent=1))
        return 0
    print(f"topic {topic.name} (id {topic.topic_id}) on {bootstrap}: {len(topic.partitions)} partition(s), "
          f"{topic.messages} message(s)")  # fmt: skip
    print(f"  retention.ms={topic.retention_ms} max.message.bytes={topic.max_message_bytes} "
          f"cleanup.policy={topic.cleanup_policy}")  # fmt: skip
    if topic.overrides:
        print("  set on the topic: " + ", ".join(f"{k}={v}" for k, v in topic.overrides.items()))
    print(f"  {'partition':>9} {'leader':>6} {'replicas':>8} {'isr':>5} {'low':>10} {'high':>10}")
    for p in topic.partitions:
        print(
            f"  {p.partition:>9} {p.leader if p.leader is not None else '-':>6} "
            f"{','.join(map(str, p.replicas)):>8} {','.join(map(str, p.isr)):>5} "
            f"{p.low_watermark:>10} {p.high_watermark:>10}"
        )
    return 0
