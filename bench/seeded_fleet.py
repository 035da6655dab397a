"""A fleet whose engines seed their block hashes per process, as vLLM does unless PYTHONHASHSEED
is fixed: every worker stores the same prompts under its own engine hashes, so one content
stands for one node per worker (docs/INDEX.md, "The compiled core's layout": content chains).

    python bench/seeded_fleet.py                         # 16 and 128 workers, ~30 s
    python bench/seeded_fleet.py --baseline-core /tmp/before/_indexcore.cpython-311-x86_64-linux-gnu.so

Per fleet size: the compiled core's ingest from Avro bytes (CPU ns per stored block of the
feeding thread, one thread), the naive pure-Python index's on the same batches decoded
(``support/index_naive.py``), and 64-block ``find_matches_for_tokens`` p50/p99 on the final
state (the naive index cannot match by tokens: each worker's hashes differ). With
``--baseline-core``, another build's core is fed the same batches in turn and queried
interleaved. Prints a table and writes ``bench/results/seeded_fleet.json``.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

sys.path[:0] = [str(Path(__file__).parent), str(Path(__file__).parent / "support")]

from index_naive import NaiveIndex  # noqa: E402
from index_sides import index_with_core, load_core, percentiles  # noqa: E402
from kvevents.consumer import CacheIndex  # noqa: E402
from kvevents.schemas import (  # noqa: E402
    EventBatch,
    KVCacheCreatedData,
    KVCacheEvent,
    KVCacheRemovedData,
    KVCacheStoredBlockData,
    KVCacheStoredData,
    decode_batch,
    encode_batch,
)

BLOCK_SIZE = 16


def fleet(
    workers: int, prompts: int, blocks: int, rounds: int, seed: int
) -> tuple[list[bytes], list[list[int]], int]:
    """(encoded batches, the prompts' token ids, blocks stored): each worker, with its own hash
    seed, stores every prompt ``rounds`` times (new hashes each round: a restart, another
    seed) and evicts a random held prompt, leaf first, once it holds half of them."""
    rng = random.Random(seed)
    tokens = [
        [[rng.randrange(1, 30_000) for _ in range(BLOCK_SIZE)] for _ in range(blocks)] for _ in range(prompts)
    ]
    batches: list[bytes] = []
    stored = 0
    for w in range(workers):
        hash_seed = rng.getrandbits(64)
        events = [KVCacheEvent(0, KVCacheCreatedData([1 << 24]), 64, 0)]
        eid = 1
        held: list[list[int]] = []
        sequence = 0
        for r in range(rounds):
            for p in range(prompts):
                hashes = [
                    (hash_seed * 1_000_003 + p * 1000 + b + r * 10**7) % (1 << 64) for b in range(blocks)
                ]
                data = KVCacheStoredData(
                    None, [KVCacheStoredBlockData(h, t) for h, t in zip(hashes, tokens[p], strict=True)]
                )
                events.append(KVCacheEvent(eid, data, 64, 0))
                eid += 1
                stored += blocks
                held.append(hashes)
                if len(held) > prompts // 2:
                    gone = held.pop(rng.randrange(len(held)))[::-1]
                    events.append(KVCacheEvent(eid, KVCacheRemovedData(gone), 64, 0))
                    eid += 1
                if len(events) >= 20:
                    batches.append(
                        encode_batch(EventBatch(f"w{w}", events, producer_id=1, sequence=sequence))
                    )
                    sequence += 1
                    events = []
        if events:
            batches.append(encode_batch(EventBatch(f"w{w}", events, producer_id=1, sequence=sequence)))
    return batches, [[t for block in prompt for t in block] for prompt in tokens], stored


def run(workers: int, args: argparse.Namespace, baseline: Any) -> dict[str, Any]:
    batches, queries, stored = fleet(workers, args.prompts, args.blocks, args.rounds, args.seed)
    decoded = [decode_batch(b) for b in batches]
    sides: dict[str, Any] = {"kvevents": lambda: CacheIndex()}
    if baseline is not None:
        sides["baseline core"] = lambda: index_with_core(baseline)
    ingest: dict[str, list[float]] = {name: [] for name in [*sides, "naive index"]}
    built: dict[str, CacheIndex] = {}
    for repeat in range(args.repeat):
        names = list(sides) if repeat % 2 == 0 else list(sides)[::-1]
        for name in names:
            index = sides[name]()
            start = time.thread_time()
            index.apply_encoded_many(batches)
            ingest[name].append((time.thread_time() - start) * 1e9 / stored)
            built[name] = index
        naive = NaiveIndex()
        start = time.thread_time()
        for batch in decoded:
            naive.apply(batch)
        ingest["naive index"].append((time.thread_time() - start) * 1e9 / stored)
    answers = {
        name: [index.find_matches_for_tokens(q, BLOCK_SIZE) for q in queries] for name, index in built.items()
    }
    identical = len({json.dumps([sorted(map(str, a.items())) for a in ans]) for ans in answers.values()}) == 1
    latencies: dict[str, list[int]] = {name: [] for name in built}
    for repeat in range(args.lookup_passes):
        for name in list(built) if repeat % 2 == 0 else list(built)[::-1]:
            find = built[name].find_matches_for_tokens
            for q in queries:
                t0 = time.perf_counter_ns()
                find(q, BLOCK_SIZE)
                latencies[name].append(time.perf_counter_ns() - t0)
    return {
        "workers": workers,
        "blocks_stored": stored,
        "ingest_cpu_ns_per_block": {name: sorted(v)[len(v) // 2] for name, v in ingest.items()},
        "ingest_runs": ingest,
        "find_matches_for_tokens_64_us": {name: percentiles(v) for name, v in latencies.items()},
        "answers_identical": identical,
    }


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--workers", default="16,128", help="fleet sizes, comma-separated (default 16,128)")
    parser.add_argument("--prompts", type=int, default=40, help="shared prompts (default 40)")
    parser.add_argument("--blocks", type=int, default=64, help="blocks per prompt (default 64)")
    parser.add_argument(
        "--rounds", type=int, default=6, help="times each worker stores every prompt (default 6)"
    )
    parser.add_argument("--repeat", type=int, default=3, help="ingest repeats, medians reported (default 3)")
    parser.add_argument("--lookup-passes", type=int, default=20, help="passes over the queries (default 20)")
    parser.add_argument("--seed", type=int, default=3)
    parser.add_argument(
        "--baseline-core", default=None, metavar="SO", help="another build's consumer/_indexcore*.so"
    )
    parser.add_argument(
        "--output", type=Path, default=Path(__file__).parent / "results" / "seeded_fleet.json"
    )
    args = parser.parse_args()
    baseline = load_core(args.baseline_core) if args.baseline_core else None
    results = []
    for workers in (int(w) for w in args.workers.split(",")):
        print(f"{workers} workers ...", file=sys.stderr, flush=True)
        results.append(run(workers, args, baseline))
    print(f"{'workers':>8} {'side':<15} {'ingest ns/block':>16} {'tokens 64 p50 us':>17} {'p99 us':>8}")
    for r in results:
        for name, ns in r["ingest_cpu_ns_per_block"].items():
            lat = r["find_matches_for_tokens_64_us"].get(name)
            p50 = f"{lat['p50_us']:17.1f}" if lat else f"{'-':>17}"
            p99 = f"{lat['p99_us']:8.1f}" if lat else f"{'-':>8}"
            print(f"{r['workers']:>8} {name:<15} {ns:16.0f} {p50} {p99}")
        if not r["answers_identical"]:
            print(f"  !! {r['workers']} workers: the sides' answers differ")
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(
        json.dumps(
            {"benchmark": "seeded_fleet", "args": vars(args) | {"output": str(args.output)}, "runs": results},
            indent=2,
        )
    )
    print(f"wrote {args.output}")
    return 0 if all(r["answers_identical"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
