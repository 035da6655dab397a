"""``kvevents export dynamo``: the topic as NVIDIA Dynamo RouterEvent JSON lines (file, stdout or
a ZMQ PUB), see :mod:`kvevents.consumer.export.dynamo_export`."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from kvevents.commands._common import (
    EXIT_INTERRUPTED,
    CommandError,
    Progress,
    add_kafka_flags,
    add_output_flags,
    command,
    config_pair,
    kafka_config,
    reader_codec,
    stop_on_interrupt,
)
from kvevents.commands._export_common import (
    add_lora_flag,
    add_start_flags,
    add_wait_flag,
    checked_bootstrap,
    start_position,
)
from kvevents.commands._format import printable

DESCRIPTION = """\
Read a kvevents topic and write NVIDIA Dynamo RouterEvent JSON, one object per line:

  {"worker_id": ID, "event": {"event_id": N, "data": DATA, "dp_rank": RANK}}

  DATA  {"stored": {"parent_hash": H|null, "blocks": [{"block_hash": H, "tokens_hash": T}]}}
        {"removed": {"block_hashes": [H, ...]}}    or    "cleared" (a Created event)

tokens_hash is Dynamo's local hash of the block's tokens (XXH3-64 of u32 LE token ids, seed
1337; a LoRA block's seed adds XXH3-64 of its adapter name: --lora-name ID=NAME, else the id's
decimal string). Updated events (cache level, priority) have no Dynamo counterpart and are left
out; so are a Stored event's blocks from the first one without tokens on (placeholders such as
vLLM's offloading connector stores: under Dynamo's tokens hash they would all be one block),
counted in blocks_left_out. ID: a stable integer per instance (XXH3-64 of its name, top bit cleared) unless --worker-id
names it; the mapping is printed on stderr. A worker whose events were lost gets "cleared" first.
Feed the lines to RadixTree.apply_event(worker_id, json.dumps(event)) (Dynamo's Python
bindings) or to tools of your own. Dynamo's router services do not read these JSON lines: they
take msgpack from Dynamo's event plane, or a vLLM-format ZMQ stream, which 'kvevents export zmq'
publishes.

Output: --output FILE (default: stdout), and/or --zmq ENDPOINT: a PUB socket sending
[--zmq-topic, JSON] per event (two frames, for subscribers of your own). Counters go to stderr
(stdout may carry the events).
"""

EPILOG = """\
examples:
  kvevents export dynamo --no-follow > events.jsonl         # the whole topic, then exit
  kvevents export dynamo --from end --zmq tcp://*:5560 --output /dev/null
  kvevents export dynamo --lora-name 3=sql-adapter --worker-id engine-0=7587888316235393281
"""


def _worker_id(text: str) -> tuple[str, int]:
    name, value = config_pair(text)
    if not value.isdigit() or int(value) >= 2**64:
        raise argparse.ArgumentTypeError(f"a worker id is an unsigned 64-bit integer, got {value!r}")
    return name, int(value)


def register_export(formats: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``export dynamo``."""
    parser = formats.add_parser(
        "dynamo",
        help="write NVIDIA Dynamo RouterEvent JSON lines (file, stdout, ZMQ)",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_kafka_flags(parser)
    read = add_start_flags(parser, "events")
    read.add_argument("--window-size", type=int, default=None, help="only this window size's events")
    out = parser.add_argument_group("where to write")
    out.add_argument(
        "--output", "-o", default="-", help="a file for the JSON lines ('-': stdout, the default)"
    )
    out.add_argument("--zmq", default=None, metavar="ENDPOINT", help="also publish on a ZMQ PUB (binds)")
    out.add_argument("--zmq-topic", default="kv-events", help="the PUB topic (default: Dynamo's kv-events)")
    add_wait_flag(out, "--zmq")
    add_lora_flag(out, "a LoRA id's adapter name, hashed into tokens_hash as Dynamo does (repeatable)")
    out.add_argument(
        "--worker-id", type=_worker_id, action="append", default=[], metavar="INSTANCE=ID", help="a worker id"
    )
    add_output_flags(parser, json_help="print the final counters as JSON (on stderr)")
    parser.set_defaults(func=run)


@command("export dynamo")
def run(args: argparse.Namespace) -> int:
    from kvevents.consumer import EventReader, ReaderError
    from kvevents.consumer.export import relaxed_gc
    from kvevents.consumer.export.dynamo_export import DynamoConverter
    from kvevents.schemas import DecodeError

    try:
        import orjson

        def dumps(obj: Any) -> bytes:
            return orjson.dumps(obj)
    except ImportError:  # orjson is optional; the stdlib gives the same JSON

        def dumps(obj: Any) -> bytes:
            return json.dumps(obj, separators=(",", ":")).encode()

    pub: Any = None
    if args.zmq is not None:
        try:
            import zmq
        except ImportError as exc:
            raise CommandError("--zmq needs pyzmq: pip install 'kvevents[bridge]'") from exc
        pub = zmq.Context.instance().socket(zmq.PUB)
        try:
            pub.bind(args.zmq.replace("tcp://*:", "tcp://0.0.0.0:"))
        except zmq.ZMQError as exc:
            raise CommandError(f"cannot bind {args.zmq}: {exc}") from exc
        if args.wait > 0:
            time.sleep(args.wait)
    topic = args.zmq_topic.encode()
    converter = DynamoConverter(
        lora_names=dict(args.lora_name), worker_ids=dict(args.worker_id), window_size=args.window_size
    )
    try:
        reader = EventReader(
            checked_bootstrap(args),
            args.topic,
            start=start_position(args),
            config=kafka_config(args),
            codec=reader_codec(args),
        )
    except ReaderError as exc:
        raise CommandError(str(exc)) from exc
    raw = sys.stdout.buffer if args.output == "-" else Path(args.output).open("wb")  # noqa: SIM115
    progress = Progress(enabled=not args.quiet)
    announced: set[str] = set()
    lines = malformed = messages = 0
    interrupted = False
    try:
        with stop_on_interrupt(reader.stop) as seen, relaxed_gc():
            for message in reader.messages(until_caught_up=not args.follow):
                try:
                    batch = reader.decode(message.value())
                except DecodeError as exc:
                    malformed += 1
                    print(
                        f"kvevents export dynamo: skipped a malformed message at offset {message.offset()}: {exc}",
                        file=sys.stderr,
                    )
                    key = message.key()
                    records = (
                        []
                        if not key
                        else converter.lose_instance(key.decode("utf-8", "replace"), "malformed")
                    )
                else:
                    if batch.instance_id not in announced:
                        announced.add(batch.instance_id)
                        if not args.quiet:
                            print(
                                f"instance {printable(batch.instance_id)} -> worker_id {converter.worker_id(batch.instance_id)}",
                                file=sys.stderr,
                            )
                    records = converter.convert(batch)
                for record in records:
                    line = dumps(record)
                    raw.write(line + b"\n")
                    if pub is not None:
                        pub.send_multipart((topic, line))
                lines += len(records)
                messages += 1
                if progress.due():
                    progress.update(f"{messages} messages read, {lines} RouterEvents written")
            interrupted = bool(seen)
            raw.flush()
    finally:
        reader.close()
        if raw is not sys.stdout.buffer:
            raw.close()
        if pub is not None:
            pub.close(linger=1000)
    progress.done()
    summary = {
        **converter.counters.__dict__,
        "lines": lines,
        "malformed": malformed,
        "worker_ids": converter.worker_ids,
    }
    print(
        json.dumps(summary, sort_keys=True)
        if args.json
        else " ".join(f"{k}={v}" for k, v in summary.items()),
        file=sys.stderr,
    )
    return EXIT_INTERRUPTED if interrupted else 0
