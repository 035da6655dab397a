"""``kvevents broker start|stop|status|fetch``: the local Kafka broker (no Docker needed)."""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING

from kvevents.commands._common import add_service_parser

if TYPE_CHECKING:
    from kvevents.broker.gclog import GcPause

DESCRIPTION = """\
Run a local Apache Kafka broker (single node, KRaft) without Docker.

The first start fetches Kafka's jars from Maven Central with 'mvn' into the cache
(~/.cache/kvevents, or $KVEVENTS_CACHE_DIR) and formats the storage; later starts take a
couple of seconds. The broker's state (data, config, broker.log, pid file) lives in
--data-dir, by default ./.kvevents/broker (or $KVEVENTS_BROKER_DIR), so that 'make demo',
'make broker-stop' and 'kvevents broker status' run from the repository root agree.
'kvevents topic ...' and the other Kafka commands find a running broker there when
KAFKA_BOOTSTRAP_SERVERS is not set.

--nodes 3 runs a KRaft cluster of 3 nodes instead (state in DATA_DIR/node-1..3, a static
controller quorum; topics default to replication factor 3, min.insync.replicas 2): for
testing what a broker failure does. 'stop' and 'status' find the nodes in the same directory.
"""

EPILOG = """\
examples:
  kvevents broker start                 # free ports; prints the bootstrap address
  kvevents broker start --port 9092     # a fixed client port
  kvevents broker status --json         # for scripts; exit code 0 running, 3 stopped
  kvevents broker stop
  kvevents broker start --nodes 3 --data-dir /tmp/kafka3   # a 3-node cluster; prints its 3 addresses
"""


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``broker`` and its sub-commands."""
    add = add_service_parser(
        subparsers,
        "broker",
        help_text="start, stop or inspect the local Kafka broker",
        description=DESCRIPTION,
        epilog=EPILOG,
        data_dir_help="the broker's state directory (default: $KVEVENTS_BROKER_DIR or ./.kvevents/broker)",
    )

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
    start.add_argument(
        "--nodes",
        type=int,
        default=1,
        help="run a KRaft cluster of this many nodes (default: 1, a single broker; free ports)",
    )
    start.set_defaults(func=_start)

    stop = add("stop", "stop the broker: SIGTERM, then SIGKILL after --timeout seconds")
    stop.add_argument(
        "--timeout", type=float, default=20.0, help="seconds to wait after SIGTERM (default: 20)"
    )
    stop.set_defaults(func=_stop)

    status = add(
        "status",
        "say whether the broker runs, its pid and bootstrap address, and the JVM's GC pauses of "
        "the last 10 minutes (exit 0 running, 3 stopped)",
    )
    status.add_argument("--json", action="store_true", help="print JSON")
    status.set_defaults(func=_status)

    fetch = add("fetch", "download Kafka's jars into the cache now (start does it when needed)")
    fetch.set_defaults(func=_fetch)


def _state_dir(args: argparse.Namespace) -> Path:
    from kvevents.broker import default_state_dir

    return Path(args.data_dir) if args.data_dir is not None else default_state_dir()


def _start_cluster(args: argparse.Namespace) -> int:
    from kvevents.broker import BrokerError
    from kvevents.broker.cluster import LocalCluster
    from kvevents.broker.jars import FetchError

    if args.nodes < 2:
        print(f"kvevents broker start: --nodes must be >= 1, got {args.nodes}", file=sys.stderr)
        return 2
    if args.port is not None or args.controller_port is not None or args.foreground:
        print(
            "kvevents broker start: --port, --controller-port and --foreground are for one node",
            file=sys.stderr,
        )
        return 2
    try:
        cluster = LocalCluster(_state_dir(args), args.nodes, host=args.host, start_timeout=args.timeout)
        statuses = cluster.start()
    except (BrokerError, FetchError, ValueError) as exc:
        print(f"kvevents broker start: {exc}", file=sys.stderr)
        return 1
    print(f"Kafka cluster of {args.nodes} nodes running: bootstrap {cluster.bootstrap_servers}")
    for i, status in enumerate(statuses, 1):
        print(f"  node {i}: pid {status.pid}, {status.bootstrap_servers}, log {status.log_file}")
    print(f"  use:   export KAFKA_BOOTSTRAP_SERVERS={cluster.bootstrap_servers}")
    return 0


def _start(args: argparse.Namespace) -> int:
    from kvevents.broker import BrokerAlreadyRunning, BrokerError, LocalBroker
    from kvevents.broker.jars import FetchError

    if args.nodes != 1:
        return _start_cluster(args)
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
    from kvevents.broker.cluster import LocalCluster, is_cluster_dir

    if is_cluster_dir(_state_dir(args)):
        nodes = len(list(_state_dir(args).glob("node-*")))
        try:
            results = LocalCluster(_state_dir(args), nodes, stop_timeout=args.timeout).stop()
        except BrokerError as exc:
            print(f"kvevents broker stop: {exc}", file=sys.stderr)
            return 1
        for i, result in enumerate(results, 1):
            print(f"node {i}: {result.describe()}")
        return 0
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
    from kvevents.broker.cluster import is_cluster_dir

    if is_cluster_dir(_state_dir(args)):
        nodes = sorted(_state_dir(args).glob("node-*"), key=lambda p: int(p.name.split("-")[1]))
        statuses = [LocalBroker(node).status(probe=True) for node in nodes]
        if args.json:
            print(
                json.dumps(
                    [
                        {
                            "node": i,
                            "running": s.running,
                            "pid": s.pid,
                            "bootstrap_servers": s.bootstrap_servers,
                            "answers": s.answers,
                            "state_dir": str(s.state_dir),
                        }
                        for i, s in enumerate(statuses, 1)
                    ]
                )
            )
        else:
            for i, status in enumerate(statuses, 1):
                print(f"node {i}: {status.describe()}")
        return 0 if all(s.running for s in statuses) else 3
    broker = LocalBroker(args.data_dir)
    status = broker.status(probe=True)
    recent = _recent_gc_pauses(broker.gc_log)
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
                    "gc_log": str(broker.gc_log),
                    "gc_pauses_last_10_min": len(recent),
                    "gc_longest_pause_ms_last_10_min": max((p.ms for p in recent), default=None),
                    "note": status.note,
                }
            )
        )
    else:
        print(status.describe())
        if status.running:
            longest = f", longest {max(p.ms for p in recent):.0f} ms" if recent else ""
            pauses = f"{len(recent)} pause{'' if len(recent) == 1 else 's'} in the last 10 minutes{longest}"
            print(
                f"  state: {status.state_dir}\n  log:   {status.log_file}\n  gc:    {broker.gc_log} ({pauses})"
            )
    return 0 if status.running else 3


def _recent_gc_pauses(gc_log: Path) -> list[GcPause]:
    """The broker's stop-the-world GC pauses of the last 10 minutes (none without a GC log)."""
    from kvevents.broker.gclog import pauses_between, read_gc_pauses

    now = time.time()
    return pauses_between(read_gc_pauses(gc_log), now - 600, now)


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
