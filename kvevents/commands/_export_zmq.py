"""``kvevents export zmq``: the topic in vLLM's ZMQ wire format, for llm-d and other vLLM-event
subscribers, with replay from Kafka (see :mod:`kvevents.consumer.export.zmq_export`)."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path
from typing import Any

from kvevents.commands._common import (
    EXIT_INTERRUPTED,
    CommandError,
    Progress,
    add_kafka_flags,
    add_output_flags,
    command,
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

log = logging.getLogger("kvevents.export")

DESCRIPTION = """\
Read a kvevents topic and publish it in vLLM's ZMQ wire format, so that an unmodified llm-d
KV-cache indexer (or any vLLM KV-event subscriber) consumes it:

  live messages   3 frames [topic, seq (u64 big-endian), msgpack batch]
  batch           [ts, events, data_parallel_rank] (an array, as vLLM's EventBatch), events as
                  arrays ["BlockStored", ...] (older vLLM's encoding: the only one llm-d-kv-cache
                  releases up to v0.8.1 read, and Dynamo's ZMQ listener reads it too);
                  --map-events sends vLLM's current tagged maps {"type": "BlockStored", ...}
                  (Dynamo; llm-d only with its map support, an open PR as of 2026-06)
  BlockStored     block_hashes, parent_block_hash (each an 8-byte uint64, as llm-d requires),
                  token_ids, block_size, lora_id, medium (cache level 0 GPU, 1 CPU, 2 DISK,
                  3 and above EXTERNAL), lora_name (--lora-name; an id without one is sent as
                  its decimal string, with a warning: routers key adapters by name, and a null
                  one made them count an adapter's blocks as the base model's), extra_keys per
                  block: (multimodal hash as hex, offset) per item, the cache salt on a
                  request's first block (not the LoRA name: llm-d reads a string there as a
                  multimodal id); group_idx is not sent (a window size does not give it)
  BlockRemoved    block_hashes, medium;  AllBlocksCleared for a Created event

Every worker (instance, attention-DP rank) gets its own topic (--topic-template, default
llm-d's kv@<pod>@<model>; <pod> is the instance id, '-dp<rank>' added for ranks > 0); seqs count
from 0 without gaps per publisher and topic (so, by default, per worker). Workers go to their own PUB (--worker) or to the shared
one (--pub). A cache-level move (Updated) becomes BlockRemoved on the old medium + BlockStored
on the new one; a worker whose events were lost (drops reported in-band, missing batches, an
event-id jump) gets AllBlocksCleared, and the producer's snapshot, when it comes, refills it.

Replay (--replay, or a second endpoint in --worker): a ROUTER socket answering vLLM's protocol
from Kafka: send [b'', start_seq (8 bytes BE)] from a DEALER (a third frame may name one
topic); the answer is [topic, seq, payload] per batch from start_seq on (--replay-frames 2:
[seq, payload]), then seq 0xffffffffffffffff with an empty payload. Batches are re-read from the
topic, re-converted from a replay anchor (one per checkpoint; with --state kept in FILE.anchors/
across restarts, at most --replay-anchors and --replay-anchor-mib, forgotten once retention
deleted their data), so a
gap within the topic's retention can be recovered, not only the last 10,000 batches; a seq older
than every retained anchor is answered from the oldest one. At most --replay-max-pending answers
go out at once, one per client: a request past that, or a client's repeat while its answer is
still going out, gets no answer (its timeout retries) and is counted in replays_refused.

--state FILE makes seqs survive restarts: offsets, seqs and the converter's memory are saved
every --checkpoint-interval seconds and on exit, and a restart resumes there (batches published
after the last save are published again with the same seqs: duplicates, never a gap). Without
--state, every start numbers the streams from 0 again (as a restarted vLLM does), which Dynamo's
indexer ignores until the seqs pass where they were: give Dynamo --state.

Routers: llm-d hashes a block under the model named in its topic (or the lora_name), so give
--model the name its scheduler uses; its pod id is the topic's middle part (the instance id,
'-dp<rank>' for ranks > 0; --pod-id gives a worker the name the scheduler knows its engine by,
llm-d's pod ip:port, each data-parallel rank on its own port). Dynamo's indexer takes one worker
and one seq counter per socket: give it one --worker publisher per (instance, rank), not the
shared --pub.

Progress and warnings go to stderr; the final counters to stdout (--json for JSON).
"""

EPILOG = """\
examples:
  # one PUB for every worker, llm-d's topic convention, replay on 5558
  kvevents export zmq --pub tcp://*:5557 --replay tcp://*:5558 --model meta-llama/Llama-3.1-8B
  # vLLM's layout (and Dynamo's): one publisher per rank of instance sim-0 (port 5557 + rank)
  kvevents export zmq --worker sim-0:0=tcp://*:5557,tcp://*:5567 \\
      --worker sim-0:1=tcp://*:5558,tcp://*:5568 --state /var/lib/kvevents/export.state
  # push to a subscriber that binds (llm-d's indexer listens), from now on
  kvevents export zmq --from end --connect --pub tcp://indexer:5557
"""


def _model(name: str | None) -> str:
    if name is None:
        log.warning(
            "no --model: topics name the model 'model'; llm-d hashes blocks under the topic's "
            "model name, so its scheduler finds nothing unless it uses that name too"
        )
        return "model"
    return name


def _endpoint(text: str) -> str:
    if "://" not in text:
        raise argparse.ArgumentTypeError(f"expected a ZMQ endpoint like tcp://*:5557, got {text!r}")
    return text.replace("tcp://*:", "tcp://0.0.0.0:")


def _who(who: str, text: str) -> tuple[str, int]:
    """``INSTANCE[:RANK]`` of ``text`` (an argparse error naming ``text``)."""
    instance, _, rank = who.rpartition(":") if ":" in who else (who, "", "0")
    if not rank.isdigit() or not instance:
        raise argparse.ArgumentTypeError(f"the worker in {text!r} must be INSTANCE[:RANK], RANK a number")
    return instance, int(rank)


def _pod_id(text: str) -> tuple[str, int, str]:
    """``INSTANCE[:RANK]=ID``."""
    who, sep, pod = text.partition("=")
    if not sep or not who or not pod:
        raise argparse.ArgumentTypeError(f"expected INSTANCE[:RANK]=ID, got {text!r}")
    if "@" in pod:
        raise argparse.ArgumentTypeError(
            f"a pod id cannot contain '@' (llm-d splits topics on it), got {pod!r}"
        )
    return (*_who(who, text), pod)


def _worker(text: str) -> tuple[str, int, str, str | None]:
    """``INSTANCE[:RANK]=PUB[,REPLAY]``."""
    who, sep, where = text.partition("=")
    if not sep or not who or not where:
        raise argparse.ArgumentTypeError(f"expected INSTANCE[:RANK]=PUB[,REPLAY], got {text!r}")
    pub, _, replay = where.partition(",")
    return (*_who(who, text), _endpoint(pub), _endpoint(replay) if replay else None)


def register_export(formats: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``export zmq``."""
    parser = formats.add_parser(
        "zmq",
        help="publish vLLM's ZMQ KV-event format (llm-d, Dynamo workers), with replay from Kafka",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_kafka_flags(parser)
    read = add_start_flags(parser, "batches")
    read.add_argument(
        "--state",
        type=Path,
        default=None,
        metavar="FILE",
        help="restart state (see above); once it exists it decides where to read from, not --from",
    )
    read.add_argument(
        "--checkpoint-interval",
        type=float,
        default=5.0,
        metavar="S",
        help="seconds between state saves (and replay anchors)",
    )
    read.add_argument(
        "--replay-anchors",
        type=int,
        default=64,
        metavar="N",
        help="replay anchors kept at most (default 64; more: shorter replay scans, more disk)",
    )
    read.add_argument(
        "--replay-anchor-mib",
        type=int,
        default=1024,  # anchors.DEFAULT_MAX_BYTES (not imported: the CLI starts light)
        metavar="MIB",
        help="MiB the replay anchors keep at most (default %(default)s; each holds the tokens of "
        "every held block, in memory without --state, else on disk); past it anchors are thinned, "
        "the oldest and newest always kept",
    )
    pub = parser.add_argument_group("where to publish")
    pub.add_argument("--pub", type=_endpoint, default=None, metavar="ENDPOINT", help="the shared PUB socket")
    pub.add_argument(
        "--replay", type=_endpoint, default=None, metavar="ENDPOINT", help="the shared PUB's replay ROUTER"
    )
    pub.add_argument(
        "--worker",
        type=_worker,
        action="append",
        default=[],
        metavar="INSTANCE[:RANK]=PUB[,REPLAY]",
        help="a worker's own PUB (and replay ROUTER), as vLLM has one per rank (repeatable)",
    )
    pub.add_argument(
        "--connect", action="store_true", help="connect the PUB sockets (default: bind); replay always binds"
    )
    pub.add_argument(
        "--model",
        default=None,
        help="the model name in topics, as the router's scheduler names it (llm-d hashes blocks "
        "under it); default 'model', with a warning",
    )
    pub.add_argument(
        "--pod-id",
        type=_pod_id,
        action="append",
        default=[],
        metavar="INSTANCE[:RANK]=ID",
        help="a worker's {pod} in topics, as the router's scheduler names that engine (llm-d: its "
        "pod's ip:port, each rank its own port); repeatable; default: the instance id, '-dp<rank>' "
        "added for ranks above 0",
    )
    pub.add_argument(
        "--topic-template",
        default="kv@{pod}@{model}",
        help="ZMQ topic of a worker's stream; fields {pod} {instance} {rank} {model} (default: "
        "%(default)s); 'kv@{instance}@{model}' puts every rank of an instance on one topic and seq, as "
        "vLLM's data-parallel ranks share a topic (the batch's data_parallel_rank tells them apart)",
    )
    add_lora_flag(
        pub, "a LoRA id's adapter name, sent as lora_name (repeatable; default null: kvevents carries ids)"
    )
    encoding = pub.add_mutually_exclusive_group()
    encoding.add_argument(
        "--map-events",
        action="store_true",
        help="events as vLLM's current tagged maps (Dynamo; llm-d with map support) instead of arrays",
    )
    encoding.add_argument(
        "--positional", action="store_true", help="events as arrays: the default (kept for older scripts)"
    )
    pub.add_argument("--replay-frames", type=int, choices=[2, 3], default=3, help="replay reply frames")
    pub.add_argument(
        "--replay-max-pending",
        type=int,
        default=8,
        metavar="N",
        help="replay answers in progress at most (default 8); a request past it, or from a client "
        "whose answer is still going out, gets no answer and is counted as refused",
    )
    add_wait_flag(pub, "the sockets")
    pub.add_argument("--hwm", type=int, default=100_000, help="PUB high-water mark in messages")
    add_output_flags(parser, json_help="print the final counters as JSON")
    parser.set_defaults(func=run)


@command("export zmq")
def run(args: argparse.Namespace) -> int:
    try:
        import zmq
    except ImportError as exc:
        raise CommandError("pyzmq is not installed: pip install 'kvevents[bridge]'") from exc
    from kvevents.consumer import ReaderError, WorkerKey
    from kvevents.consumer.export import relaxed_gc
    from kvevents.consumer.export.zmq_export import Endpoint, ZmqExportConfig, ZmqExporter

    bind = not args.connect
    workers = {
        WorkerKey(instance, rank): (Endpoint(pub, bind), None if replay is None else Endpoint(replay))
        for instance, rank, pub, replay in args.worker
    }
    try:
        config = ZmqExportConfig(
            checked_bootstrap(args),
            args.topic,
            pub=None if args.pub is None else Endpoint(args.pub, bind),
            replay=None if args.replay is None else Endpoint(args.replay),
            workers=workers,
            model=_model(args.model),
            topic_template=args.topic_template,
            pod_ids={WorkerKey(instance, rank): pod for instance, rank, pod in args.pod_id},
            positional=not args.map_events,
            replay_frames=args.replay_frames,
            start=start_position(args),
            state_path=args.state,
            checkpoint_interval_s=args.checkpoint_interval,
            replay_anchors=args.replay_anchors,
            replay_anchor_bytes=args.replay_anchor_mib << 20,
            replay_max_pending=args.replay_max_pending,
            reader_config=kafka_config(args),
            codec=reader_codec(args),
            hwm=args.hwm,
            start_delay_s=args.wait,
            lora_names=dict(args.lora_name),
        )
        exporter = ZmqExporter(config)
    except (ValueError, ReaderError) as exc:
        raise CommandError(str(exc)) from exc
    except zmq.ZMQError as exc:
        raise CommandError(f"cannot open a ZMQ socket: {exc}") from exc
    progress = Progress(enabled=not args.quiet)

    def show(stats: Any) -> None:
        progress.update(
            f"{stats.messages_read} messages read, {stats.batches_published} batches "
            f"({stats.events_published} events) published, {stats.replays} replays"
        )

    interrupted = False
    try:
        with stop_on_interrupt(exporter.stop) as seen, relaxed_gc():
            stats = exporter.run(until_caught_up=not args.follow, progress=show, progress_interval_s=1.0)
            interrupted = bool(seen)
    except ReaderError as exc:
        raise CommandError(str(exc)) from exc
    finally:
        exporter.close()
    progress.done()
    summary = {**stats.to_json(), **exporter.converter.counters.__dict__, "streams": len(exporter.seqs)}
    if args.json:
        print(json.dumps(summary, sort_keys=True))
    else:
        for key, value in summary.items():
            print(f"{key:24} {value}")
    sys.stdout.flush()
    return EXIT_INTERRUPTED if interrupted else 0
