"""``kvevents bridge vllm|sglang|trtllm``: a running engine's own KV-cache events onto the topic."""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

from ._common import (
    CommandError,
    Progress,
    add_kafka_flags,
    add_output_flags,
    command,
    kafka_config,
    reader_codec,
    resolve_bootstrap,
    writer_codec,
)

DESCRIPTION = """\
Read the KV-cache events an inference engine already publishes and produce them to a Kafka
topic as kvevents batches, without changing the engine.

  vllm, sglang  subscribe to the engine's ZMQ publishers: one SUB per data-parallel rank at
                --endpoint with the port + rank (as the engines bind them). Sequence gaps are
                filled from --replay-endpoint (a DEALER socket; off in the engines by default),
                and what cannot be filled is reported in-band as lost, so indexes mark that
                worker degraded. A seq going back means the engine restarted: a Created event.
                --state FILE keeps the last seq per rank, the event ids and the tier map, saved
                only when Kafka acknowledged everything before it: a bridge killed and restarted
                with the same --state replays what it missed and duplicates nothing.
  trtllm        poll trtllm-serve's POST /kv_cache_events (--url) and map each event dict.

Progress goes to stderr; at the end a JSON summary goes to stdout.
"""

EPILOG = """\
examples:
  vllm serve MODEL --kv-events-config '{"enable_kv_cache_events": true, "publisher": "zmq",
      "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5657"}'
  kvevents bridge vllm --endpoint tcp://127.0.0.1:5557 --replay-endpoint tcp://127.0.0.1:5657 \\
      --instance-id vllm-0 --state /var/lib/kvevents/vllm-0.state
  kvevents bridge sglang --endpoint tcp://127.0.0.1:5557 --dp-size 4 --instance-id sgl-0
  kvevents bridge trtllm --url http://127.0.0.1:8000 --instance-id trt-0

exit status: 0 stopped cleanly; 1 events were lost without an in-band report (see the summary),
2 bad arguments; 130 interrupted before a clean stop.
"""


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``bridge`` with ``vllm``, ``sglang`` and ``trtllm``."""
    parser = subparsers.add_parser(
        "bridge",
        help="a running vLLM / SGLang / TensorRT-LLM engine's KV events onto the topic",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    engines = parser.add_subparsers(dest="engine", metavar="ENGINE", required=True)
    for name in ("vllm", "sglang"):
        sub = engines.add_parser(
            name,
            help=f"{name}'s ZMQ KV events (--kv-events-config publisher zmq)",
            description=DESCRIPTION,
            epilog=EPILOG,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        zmq = sub.add_argument_group("engine (ZMQ)")
        zmq.add_argument(
            "--endpoint",
            default="tcp://127.0.0.1:5557",
            help="rank 0's PUB address; rank r is at port + r (default: %(default)s)",
        )
        zmq.add_argument(
            "--dp-size", type=int, default=1, help="data-parallel ranks, one SUB each (default: 1)"
        )
        zmq.add_argument(
            "--replay-endpoint",
            default=None,
            help="rank 0's replay ROUTER (port + r per rank); without it gaps are losses",
        )
        zmq.add_argument("--zmq-topic", default="", help="ZMQ topic prefix to subscribe to (default: all)")
        zmq.add_argument(
            "--window-size", type=int, default=0, help="window size of full-attention events (default: 0)"
        )
        zmq.add_argument(
            "--state",
            type=Path,
            default=None,
            metavar="FILE",
            help="state file for restarts without loss or duplicates",
        )
        zmq.add_argument(
            "--checkpoint-interval", type=float, default=2.0, help="seconds between state saves (default: 2)"
        )
        zmq.add_argument(
            "--replay-timeout",
            type=float,
            default=2.0,
            help="seconds to wait for a replay reply (default: 2)",
        )
        zmq.add_argument(
            "--max-queued",
            type=int,
            default=100_000,
            help="messages the socket thread queues before dropping (counted; default: 100000)",
        )
        zmq.add_argument(
            "--rcvhwm",
            type=int,
            default=100_000,
            help="ZMQ receive high-water mark per SUB (default: 100000)",
        )
        _common_flags(sub)
        sub.set_defaults(func=_run_zmq)
    trt = engines.add_parser(
        "trtllm",
        help="TensorRT-LLM's trtllm-serve /kv_cache_events",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    group = trt.add_argument_group("engine (HTTP)")
    group.add_argument("--url", required=True, help="trtllm-serve's base URL, e.g. http://127.0.0.1:8000")
    group.add_argument(
        "--poll-interval",
        type=float,
        default=0.05,
        help="seconds between polls that returned nothing (default: 0.05)",
    )
    group.add_argument(
        "--dp-size", type=int, default=1, help="attention-DP size stamped on batches (default: 1)"
    )
    _common_flags(trt)
    trt.set_defaults(func=_run_trtllm)


def _common_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("run")
    group.add_argument(
        "--instance-id", required=True, help="names the engine instance on the topic (the message key)"
    )
    group.add_argument(
        "--duration",
        type=float,
        default=None,
        help="stop after this many seconds (default: run until Ctrl-C/SIGTERM)",
    )
    add_kafka_flags(parser)
    add_output_flags(parser, json_help=None)


def _stop_event() -> threading.Event:
    stop = threading.Event()
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop.set())
    return stop


def _pump(source: Any, sink: Any, args: argparse.Namespace, stop: threading.Event) -> None:
    progress = Progress(enabled=not args.quiet)
    deadline = None if args.duration is None else time.monotonic() + args.duration
    while not stop.is_set() and (deadline is None or time.monotonic() < deadline):
        stop.wait(0.2)
        if progress.due():
            s = sink.stats()
            progress.update(
                f"bridge {args.engine}: {s.events_delivered_total} events delivered, {s.in_flight_events} in flight"
            )
    progress.done()


def _finish(summary: dict[str, Any], report: Any) -> int:
    summary["sink_close"] = {
        "undelivered_by_rank": report.undelivered_by_rank,
        "unreported_by_rank": report.unreported_by_rank,
        "clean": report.clean,
    }
    print(json.dumps(summary, default=str))
    return 0 if not report.unreported_by_rank else 1


@command("bridge")
def _run_zmq(args: argparse.Namespace) -> int:
    try:
        import zmq  # noqa: F401
    except ImportError:
        raise CommandError("pyzmq is missing: pip install 'kvevents[bridge]'") from None
    from kvevents.producer import KafkaEventSink
    from kvevents.producer.bridge.live import ZmqBridge

    if args.dp_size < 1:
        raise CommandError(f"--dp-size must be >= 1, got {args.dp_size}", 2)
    config = {**kafka_config(args), "bootstrap.servers": resolve_bootstrap(args)}  # -b wins over -F
    stop = _stop_event()
    in_kafka = in_kafka_blocks = None
    if args.state is not None and args.state.exists():
        from kvevents.producer.bridge.kafka_tail import last_events
        from kvevents.schemas import decode_batch

        try:
            reader = reader_codec(args)
            tail = last_events(
                config["bootstrap.servers"],
                args.topic,
                args.instance_id,
                ranks=args.dp_size,
                config=kafka_config(args),
                decode=reader.decode_batch if reader is not None else decode_batch,
            )
            in_kafka = {r: e.event_id for r, e in tail.items()}
            in_kafka_blocks = {r: e.blocks for r, e in tail.items() if e.blocks is not None}
        except RuntimeError as exc:
            raise CommandError(
                f"restarting from {args.state} needs the topic's last event ids: {exc}"
            ) from None
        print(
            f"kvevents bridge {args.engine}: restarting from {args.state}; the topic holds event ids up to {in_kafka}",
            file=sys.stderr,
        )
    try:
        bridge = ZmqBridge(
            args.engine,
            args.endpoint,
            dp_size=args.dp_size,
            replay_endpoint=args.replay_endpoint,
            topic=args.zmq_topic.encode(),
            window_size=args.window_size,
            state_path=args.state,
            max_queued=args.max_queued,
            rcvhwm=args.rcvhwm,
            replay_timeout=args.replay_timeout,
            checkpoint_interval=args.checkpoint_interval,
            in_kafka=in_kafka,
            in_kafka_blocks=in_kafka_blocks,
        )
    except ValueError as exc:
        raise CommandError(str(exc)) from None
    sink = KafkaEventSink(
        bridge,
        args.topic,
        args.instance_id,
        config=config,
        attention_dp_size=args.dp_size,
        codec=writer_codec(args, args.topic),
        on_delivery=bridge.on_delivery,
    )
    bridge.watch(sink)
    print(
        f"kvevents bridge {args.engine}: {args.endpoint} x{args.dp_size} -> {args.topic} as {args.instance_id}",
        file=sys.stderr,
    )
    try:
        _pump(bridge, sink, args, stop)
    finally:
        bridge.close()
        report = sink.close()
    return _finish({"engine": args.engine, "instance_id": args.instance_id, **bridge.stats()}, report)


@command("bridge")
def _run_trtllm(args: argparse.Namespace) -> int:
    from kvevents.producer import KafkaEventSink
    from kvevents.producer.trtllm import TrtllmEventSource, poll_trtllm_serve

    config = {**kafka_config(args), "bootstrap.servers": resolve_bootstrap(args)}  # -b wins over -F
    stop = _stop_event()
    source = TrtllmEventSource(
        poll_trtllm_serve(args.url), attention_dp_size=args.dp_size, idle_sleep=args.poll_interval
    )
    sink = KafkaEventSink(
        source,
        args.topic,
        args.instance_id,
        config=config,
        attention_dp_size=args.dp_size,
        codec=writer_codec(args, args.topic),
    )
    print(f"kvevents bridge trtllm: {args.url} -> {args.topic} as {args.instance_id}", file=sys.stderr)
    try:
        _pump(source, sink, args, stop)
    finally:
        source.close()
        report = sink.close()
    return _finish({"engine": "trtllm", "instance_id": args.instance_id, **source.stats()}, report)
