"""``kvevents route``: the best worker for prompts, by the global cache index; ``--serve``
answers ``POST /match`` over HTTP for load balancers in other languages."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from kvevents.consumer.follower import DEFAULT_READY_MAX_LAG
from kvevents.consumer.liveness import DEFAULT_STALE_AFTER_S

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
from kvevents.commands._shutdown import sigterm_as_sigint

DESCRIPTION = """\
Build the global cache index (from the topic, or a checkpoint caught up with it), then for
each prompt print the best worker and the per-worker scores: how many leading full blocks of
the prompt each worker holds (matched by content: token ids, block size and LoRA id, so no
engine hash function is needed). Workers holding nothing of the prompt are not listed.

Prompts: --tokens FILE (one prompt per line: token ids separated by whitespace or commas,
or a JSON list; '#' lines are comments), or --synthetic N held-out requests of the
simulator's workload (producer/simulator/workload.py; --seed and --content-seed as for simulate).

--serve instead answers HTTP (uvicorn; see the README's "route --serve") while each worker
process keeps following the topic (a LiveIndex replica):
  POST /match         {"token_ids": [...], "block_size": 32, "lora_id": null} or a batch
                      {"prompts": [{"token_ids": [...], "lora_id": null}, ...], "block_size": 32}
                      -> {"blocks", "scores": [{"instance_id", "attention_dp_rank", "matched_blocks",
                          "primary_blocks", "score", "degraded"}], "best", "left_out"} (batch:
                          {"results": [...]}); stale and closed workers are left out, and listed
  POST /match/hashes  {"block_hashes": [...]} (the engine's block hashes) or {"prompts": [...]}
  GET /workers        every worker: blocks, degraded flag and reasons, liveness state
  GET /healthz        200 while the process serves
  GET /readyz         200 when the follower runs, the broker answers and the lag is at most
                      --ready-max-lag messages; else 503 with the reasons
  GET /metrics        Prometheus text: lag, rates, malformed, degraded/stale workers, index
                      size, requests and latency histograms (per process)
Errors are JSON {"error", "status"}: 400 bad body, 404, 405 (with Allow), 408 slow client,
411 no length, 413 body over --max-body-bytes, 503 too many connections. SIGTERM or SIGINT
stops gracefully and saves the checkpoint (--save-checkpoint, --checkpoint-topic).
"""

EPILOG = """\
examples:
  kvevents route --tokens prompts.txt --block-size 32
  kvevents route --synthetic 20 --seed 1 --json
  kvevents route --checkpoint idx.ckpt --save-checkpoint idx.ckpt --serve --port 8080 --workers 2
  curl -s localhost:8080/match -d '{"token_ids": [1,2,3], "block_size": 32}'
  curl -s localhost:8080/readyz
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
    add_index_flags(parser)  # route --serve saves on exit
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
    serve.add_argument(
        "--workers",
        type=int,
        default=1,
        help="server processes, each a replica following the topic (default: 1; 2 on a 2-core host "
        "doubles the request rate)",
    )
    serve.add_argument(
        "--save-checkpoint",
        type=Path,
        default=None,
        metavar="FILE",
        help="with --serve: save a checkpoint here when stopped (SIGTERM, SIGINT)",
    )
    serve.add_argument(
        "--stale-after",
        type=float,
        default=DEFAULT_STALE_AFTER_S,
        metavar="S",
        help="an instance silent this long (no batch, no heartbeat) is stale and not routed to "
        f"(default: {DEFAULT_STALE_AFTER_S:g})",
    )
    serve.add_argument(
        "--ready-max-lag",
        type=int,
        default=DEFAULT_READY_MAX_LAG,
        metavar="N",
        help=f"/readyz answers 503 when more than N messages behind (default: {DEFAULT_READY_MAX_LAG})",
    )
    serve.add_argument(
        "--max-body-bytes", type=int, default=4 * 1024 * 1024, help="request body limit (default: 4 MiB)"
    )
    serve.add_argument(
        "--max-connections", type=int, default=4096, help="open connections per process (default: 4096)"
    )
    serve.add_argument(
        "--header-timeout",
        type=float,
        default=10.0,
        metavar="S",
        help="a request's head must arrive within S seconds (default: 10)",
    )
    serve.add_argument(
        "--body-timeout", type=float, default=30.0, metavar="S", help="and its body within S (default: 30)"
    )
    serve.add_argument(
        "--keep-alive",
        type=float,
        default=5.0,
        metavar="S",
        help="idle connections close after S (default: 5)",
    )
    serve.add_argument(
        "--shared-socket",
        action="store_true",
        help="with --workers > 1, one listening socket shared by every process instead of one each "
        "(SO_REUSEPORT, the default: the kernel spreads connections evenly; shared, a burst of "
        "new connections can all go to one process)",
    )
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
    if args.lora_id is not None and not 0 <= args.lora_id < 1 << 64:
        raise CommandError("--lora-id must be within 0..2**64-1", code=2)
    if args.serve:
        for name in ("workers", "max_body_bytes", "max_connections"):
            if getattr(args, name) < 1:
                raise CommandError(f"--{name.replace('_', '-')} must be >= 1", code=2)
        for name in ("stale_after", "header_timeout", "body_timeout", "keep_alive"):
            if not getattr(args, name) > 0:
                raise CommandError(f"--{name.replace('_', '-')} must be > 0", code=2)
    elif args.save_checkpoint is not None:
        raise CommandError("--save-checkpoint is for --serve", code=2)


@command("route")
def run(args: argparse.Namespace) -> int:
    """Run ``kvevents route``."""
    _check(args)
    prompts = None if args.serve else _prompts(args)
    show = Progress(enabled=not args.quiet)
    built = build_index(args, catch_up=False)
    with stop_on_interrupt(built.reader.stop) as interrupted, sigterm_as_sigint():
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
    from kvevents.commands._route_serve import serve_live

    return serve_live(args, built)
