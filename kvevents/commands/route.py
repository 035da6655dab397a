"""``kvevents route``: the best worker for prompts, by the global cache index; ``--serve``
answers ``POST /match`` over HTTP for load balancers in other languages."""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
from pathlib import Path
from types import FrameType
from typing import Any

from kvevents.commands._common import (
    EXIT_INTERRUPTED,
    CommandError,
    Progress,
    add_kafka_flags,
    add_output_flags,
    command,
    stop_on_interrupt,
)
from kvevents.commands._index_build import Built, add_index_flags, build_index, catch_up_with_topic

DESCRIPTION = """\
Build the global cache index (from the topic, or a checkpoint caught up with it), then for
each prompt print the best worker and the per-worker scores: how many leading full blocks of
the prompt each worker holds (matched by content: token ids, block size and LoRA id, so no
engine hash function is needed). Workers holding nothing of the prompt are not listed.

Prompts: --tokens FILE (one prompt per line: token ids separated by whitespace or commas,
or a JSON list; '#' lines are comments), or --synthetic N held-out requests of the
simulator's workload (producer/simulator/workload.py; --seed and --content-seed as for simulate).

--serve instead answers HTTP while a background thread keeps following the topic:
  POST /match  {"token_ids": [...], "block_size": 32, "lora_id": null}
               -> {"blocks": n, "scores": [{"instance_id", "attention_dp_rank",
                   "matched_blocks", "primary_blocks", "score"}, ...], "best": {...} | null}
               (optional "secondary_weight" 0..1 and "window_size"; bad JSON -> 400 {"error"})
  GET /healthz -> {"status": "ok", "caught_up", "lag_messages", "workers", ...}
  GET /workers -> every worker's blocks per window and cache level, degraded flag
"""

EPILOG = """\
examples:
  kvevents route --tokens prompts.txt --block-size 32
  kvevents route --synthetic 20 --seed 1 --json
  kvevents route --checkpoint idx.ckpt --serve --port 8080
  curl -s localhost:8080/match -d '{"token_ids": [1,2,3], "block_size": 32}'
"""


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``route``."""
    parser = subparsers.add_parser(
        "route",
        help="best worker and per-worker scores for prompts; --serve answers POST /match",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_kafka_flags(parser)
    add_index_flags(parser, saves=False)
    prompts = parser.add_argument_group("prompts")
    source = prompts.add_mutually_exclusive_group()
    source.add_argument("--tokens", type=Path, default=None, metavar="FILE", help="prompts, one per line")
    source.add_argument(
        "--synthetic", type=int, default=None, metavar="N", help="N held-out simulator requests"
    )
    prompts.add_argument("--seed", type=int, default=0, help="seed of the synthetic requests (default: 0)")
    prompts.add_argument(
        "--content-seed",
        type=int,
        default=0,
        help="seed of the shared content (as the simulators'; default: 0)",
    )
    scoring = parser.add_argument_group("scoring")
    scoring.add_argument(
        "--block-size", type=int, default=32, help="tokens per block, as the engines' (default: 32)"
    )
    scoring.add_argument(
        "--lora-id", type=int, default=None, help="LoRA id of --tokens prompts (default: none)"
    )
    scoring.add_argument(
        "--secondary-weight",
        type=float,
        default=1.0,
        help="what a block held only at a secondary (offloaded) level is worth, 0..1 (default: 1, "
        "like a primary block)",
    )
    scoring.add_argument("--window-size", type=int, default=None, help="match this window size only")
    scoring.add_argument(
        "--top", type=int, default=5, help="workers listed per prompt in text output (default: 5)"
    )
    serve = parser.add_argument_group("serving")
    serve.add_argument("--serve", action="store_true", help="answer HTTP requests instead of routing prompts")
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    serve.add_argument("--port", type=int, default=8080, help="port (default: 8080; 0 picks a free one)")
    add_output_flags(parser, json_help="print one JSON object (every prompt's scores and a summary)")
    parser.set_defaults(func=run)


def _prompts(args: argparse.Namespace) -> list[Any]:
    from kvevents.commands._routing import Prompt, read_token_file

    if args.tokens is not None:
        try:
            return read_token_file(args.tokens, args.lora_id)
        except ValueError as exc:
            raise CommandError(str(exc), code=2) from exc
    from kvevents.producer.simulator.workload import WorkloadConfig, WorkloadGenerator

    generator = WorkloadGenerator(WorkloadConfig(seed=args.seed, content_seed=args.content_seed))
    return [
        Prompt(f"synthetic:{i}", r.prompt.tolist(), r.lora_id)
        for i, r in enumerate(generator.held_out(args.synthetic, args.seed))
    ]


def _check(args: argparse.Namespace) -> None:
    if not args.serve and args.tokens is None and args.synthetic is None:
        raise CommandError("give prompts with --tokens FILE or --synthetic N, or --serve", code=2)
    if args.serve and (args.tokens is not None or args.synthetic is not None):
        raise CommandError("--serve answers HTTP requests: drop --tokens/--synthetic", code=2)
    if args.synthetic is not None and args.synthetic < 1:
        raise CommandError("--synthetic must be >= 1", code=2)
    if args.block_size < 1:
        raise CommandError("--block-size must be >= 1", code=2)
    if not 0.0 <= args.secondary_weight <= 1.0:
        raise CommandError("--secondary-weight must be within 0..1", code=2)


@command("route")
def run(args: argparse.Namespace) -> int:
    """Run ``kvevents route``."""
    _check(args)
    prompts = None if args.serve else _prompts(args)
    show = Progress(enabled=not args.quiet)
    built = build_index(args, catch_up=False)
    with stop_on_interrupt(built.reader.stop) as interrupted:
        try:
            catch_up_with_topic(built, show)
        except BaseException:
            built.close()
            raise
    show.done()
    if interrupted:
        built.close()
        print("kvevents route: interrupted while building the index", file=sys.stderr)
        return EXIT_INTERRUPTED
    if args.serve:
        return _serve(args, built)
    built.close()
    assert prompts is not None
    return _route(args, built, prompts)


def _route(args: argparse.Namespace, built: Built, prompts: list[Any]) -> int:
    from kvevents.commands._routing import score_prompt

    results = []
    hits = matched_total = blocks_total = 0
    for prompt in prompts:
        blocks, scores = score_prompt(
            built.index,
            prompt.tokens,
            args.block_size,
            prompt.lora_id,
            secondary_weight=args.secondary_weight,
            window_size=args.window_size,
        )
        best = scores[0] if scores else None
        hits += best is not None
        matched_total += 0 if best is None else best.matched_blocks
        blocks_total += blocks
        results.append((prompt, blocks, scores))
    workers = len(built.index.workers())
    summary = {
        "prompts": len(prompts),
        "workers": workers,
        "prompts_with_a_hit": hits,
        "blocks": blocks_total,
        "best_matched_blocks": matched_total,
        "hit_rate": round(matched_total / blocks_total, 4) if blocks_total else 0.0,
    }
    if args.json:
        out = {
            "summary": summary,
            "prompts": [
                {
                    "prompt": p.name,
                    "tokens": len(p.tokens),
                    "lora_id": p.lora_id,
                    "blocks": blocks,
                    "best": scores[0].to_json() if scores else None,
                    "scores": [s.to_json() for s in scores],
                }
                for p, blocks, scores in results
            ],
        }
        print(json.dumps(out))
        return 0
    for prompt, blocks, scores in results:
        head = f"{prompt.name}: {len(prompt.tokens)} tokens, {blocks} block(s)"
        if prompt.lora_id is not None:
            head += f", lora {prompt.lora_id}"
        if not scores:
            print(f"{head}: no worker holds its first block (any worker will do)")
            continue
        best = scores[0]
        print(f"{head}: best {best.instance_id} r{best.attention_dp_rank} ({_describe(best)})")
        for s in scores[: max(0, args.top)]:
            print(f"    {s.instance_id:<20} r{s.attention_dp_rank:<3} {_describe(s)}")
        if len(scores) > args.top:
            print(f"    ... {len(scores) - args.top} more worker(s) with a match")
    print(
        f"{summary['prompts']} prompt(s) over {workers} worker(s): {hits} with a cached prefix; the best workers "
        f"hold {matched_total}/{blocks_total} of their blocks ({summary['hit_rate'] * 100:.1f}%)"
    )
    return 0


def _describe(score: Any) -> str:
    text = f"{score.matched_blocks} block(s)"
    if score.primary_blocks != score.matched_blocks:
        text += f", {score.primary_blocks} primary, score {score.score:g}"
    return text


def _serve(args: argparse.Namespace, built: Built) -> int:
    from kvevents.commands._route_server import IndexFollower, MatchServer

    lock = threading.Lock()
    follower = IndexFollower(built.index, built.reader, lock)
    try:
        server = MatchServer((args.host, args.port), built.index, lock, follower, args.block_size)
    except OSError as exc:
        built.close()
        raise CommandError(f"cannot listen on {args.host}:{args.port}: {exc.strerror or exc}") from exc
    follower.start()
    workers = len(built.index.workers())
    print(
        f"serving on {server.url} (POST /match, GET /healthz, GET /workers); {workers} worker(s); Ctrl-C stops",
        flush=True,
    )
    interrupted = False

    def on_term(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt  # SIGTERM (docker stop, kill) stops like Ctrl-C

    previous = signal.signal(signal.SIGTERM, on_term)
    try:
        server.serve_forever(poll_interval=0.2)
    except KeyboardInterrupt:
        interrupted = True
    finally:
        signal.signal(signal.SIGTERM, previous)
        server.server_close()
        follower.stop()
        built.close()
    status = follower.status
    print(
        f"served {server.requests_served} request(s); {status.get('events', 0):,} events read; "
        f"lag {status.get('lag_messages', 0):,} msgs"
        + (f"; follower error: {follower.error}" if follower.error else ""),
        file=sys.stderr,
    )
    return EXIT_INTERRUPTED if interrupted else 0
