"""``kvevents broker start|stop|status|fetch``: the local Kafka broker (no Docker needed)."""

from __future__ import annotations

import argparse
import json
import signal
import sys
from pathlib import Path
from types import FrameType

DESCRIPTION = """\
Run a local Apache Kafka broker (single node, KRaft) without Docker.

The first start fetches Kafka's jars from Maven Central with 'mvn' into the cache
(~/.cache/kvevents, or $KVEVENTS_CACHE_DIR) and formats the storage; later starts take a
couple of seconds. The broker's state (data, config, broker.log, pid file) lives in
--data-dir, by default ./.kvevents/broker (or $KVEVENTS_BROKER_DIR), so that 'make demo',
'make broker-stop' and 'kvevents broker status' run from the repository root agree.
'kvevents topic ...' and the other Kafka commands find a running broker there when
KAFKA_BOOTSTRAP_SERVERS is not set.
"""

EPILOG = """\
examples:
  kvevents broker start                 # free ports; prints the bootstrap address
  kvevents broker start --port 9092     # a fixed client port
  kvevents broker status --json         # for scripts; exit code 0 running, 3 stopped
  kvevents broker stop
"""


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``broker`` and its sub-commands."""
    parser = subparsers.add_parser(
        "broker",
        help="start, stop or inspect the local Kafka broker",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    actions = parser.add_subparsers(dest="broker_command", metavar="ACTION", required=True)

    def add(name: str, help_text: str) -> argparse.ArgumentParser:
        sub = actions.add_parser(name, help=help_text, description=help_text)
        if name != "fetch":
            sub.add_argument(
                "--data-dir",
                type=Path,
                default=None,
                help="the broker's state directory (default: $KVEVENTS_BROKER_DIR or ./.kvevents/broker)",
            )
        return sub

    start = add("start", "start the broker in the background; return when it answers metadata requests")
    start.add_argument(
        "--port",
        type=int,
        default=None,
        help="client (PLAINTEXT) port; default: the previous one if free, else a free one",
    )
    start.add_argument(
        "--controller-port", type=int, default=None, help="KRaft controller port (default: free)"
    )
    start.add_argument(
        "--host", default="127.0.0.1", help="address to listen on and advertise (default: 127.0.0.1)"
    )
    start.add_argument(
        "--timeout", type=float, default=90.0, help="seconds to wait for the broker to answer (default: 90)"
    )
    start.add_argument(
        "--foreground", action="store_true", help="stay attached; Ctrl-C or SIGTERM stops the broker"
    )
    start.set_defaults(func=_start)

    stop = add("stop", "stop the broker: SIGTERM, then SIGKILL after --timeout seconds")
    stop.add_argument(
        "--timeout", type=float, default=20.0, help="seconds to wait after SIGTERM (default: 20)"
    )
    stop.set_defaults(func=_stop)

    status = add(
        "status", "say whether the broker runs, its pid and bootstrap address (exit 0 running, 3 stopped)"
    )
    status.add_argument("--json", action="store_true", help="print JSON")
    status.set_defaults(func=_status)

    fetch = add("fetch", "download Kafka's jars into the cache now (start does it when needed)")
    fetch.set_defaults(func=_fetch)


def _start(args: argparse.Namespace) -> int:
    from kvevents.broker import BrokerAlreadyRunning, BrokerError, LocalBroker
    from kvevents.broker.jars import FetchError

    broker = LocalBroker(
        args.data_dir,
        port=args.port,
        controller_port=args.controller_port,
        host=args.host,
        start_timeout=args.timeout,
        stop_with_parent=args.foreground,
    )
    try:
        status = broker.start()
    except BrokerAlreadyRunning as exc:
        print(f"already running: pid {exc.status.pid}, bootstrap {exc.status.bootstrap_servers}")
        return 0
    except (BrokerError, FetchError) as exc:
        print(f"kvevents broker start: {exc}", file=sys.stderr)
        return 1
    print(
        f"Kafka broker running: bootstrap {status.bootstrap_servers}, pid {status.pid}, "
        f"started in {broker.last_start_seconds:.1f} s\n"
        f"  state: {broker.state_dir}\n  log:   {status.log_file}\n"
        f"  use:   export KAFKA_BOOTSTRAP_SERVERS={status.bootstrap_servers}"
    )
    if not args.foreground:
        return 0
    print("  (foreground: Ctrl-C stops it)", flush=True)

    def on_term(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    try:
        code = broker.wait()
        print(f"the broker exited by itself with code {code}; see {status.log_file}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        result = broker.stop()
        print(result.describe())
        return 0


def _stop(args: argparse.Namespace) -> int:
    from kvevents.broker import BrokerError, LocalBroker

    broker = LocalBroker(args.data_dir, stop_timeout=args.timeout)
    try:
        result = broker.stop()
    except BrokerError as exc:
        print(f"kvevents broker stop: {exc}", file=sys.stderr)
        return 1
    print(result.describe() + ("" if result.was_running else f" in {broker.state_dir}"))
    return 0


def _status(args: argparse.Namespace) -> int:
    from kvevents.broker import LocalBroker

    broker = LocalBroker(args.data_dir)
    status = broker.status(probe=True)
    if args.json:
        print(
            json.dumps(
                {
                    "running": status.running,
                    "pid": status.pid,
                    "bootstrap_servers": status.bootstrap_servers,
                    "answers": status.answers,
                    "state_dir": str(status.state_dir),
                    "log_file": str(status.log_file),
                    "note": status.note,
                }
            )
        )
    else:
        print(status.describe())
        if status.running:
            print(f"  state: {status.state_dir}\n  log:   {status.log_file}")
    return 0 if status.running else 3


def _fetch(args: argparse.Namespace) -> int:
    from kvevents.broker.jars import FetchError, ensure_kafka_jars

    try:
        dist = ensure_kafka_jars()
    except FetchError as exc:
        print(f"kvevents broker fetch: {exc}", file=sys.stderr)
        return 1
    jars = len(list(dist.libs.glob("*.jar")))
    how = f"fetched in {dist.fetch_seconds:.1f} s" if dist.fetched_now else "already cached"
    print(f"Kafka {dist.version}: {jars} jars in {dist.libs} ({how})")
    return 0
