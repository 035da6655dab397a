"""A synthetic routing index for ``bench/route_serve.py``: ``workers`` workers each holding a
share of ``prompts`` 64-block prompts (shared system-prompt prefixes, unique tails), engine block
hashes equal to the content hashes (so ``/match`` and ``/match/hashes`` agree), and the request
bodies of held-out queries (single and batch form)."""

from __future__ import annotations

import json
import random
from array import array
from dataclasses import dataclass

from kvevents.consumer import CacheIndex
from kvevents.schemas import EventBatch, KVCacheEvent, KVCacheStoredBlockData, KVCacheStoredData

BLOCK_SIZE = 32


@dataclass
class Workload:
    index: CacheIndex
    single: list[bytes]  # POST /match bodies, one prompt each
    hashes: list[bytes]  # POST /match/hashes bodies
    batch: list[bytes]  # POST /match bodies with "prompts": [...]
    batch_size: int
    blocks_per_prompt: int


def _prompt(rng: random.Random, system: list[int], blocks: int) -> list[int]:
    tail = [rng.randrange(1, 50_000) for _ in range((blocks * BLOCK_SIZE) - len(system))]
    return system + tail


def build(workers: int = 256, blocks: int = 64, prompts: int = 512, per_worker: int = 24, batch_size: int = 16,
          queries: int = 256, seed: int = 7) -> Workload:  # fmt: skip
    rng = random.Random(seed)
    systems = [[rng.randrange(1, 50_000) for _ in range(16 * BLOCK_SIZE)] for _ in range(8)]
    corpus = [_prompt(rng, systems[i % len(systems)], blocks) for i in range(prompts)]
    index = CacheIndex()
    for w in range(workers):
        events = []
        for event_id, p in enumerate(rng.sample(range(prompts), per_worker)):
            tokens = corpus[p]
            hashes = index.content_hashes(tokens, BLOCK_SIZE)
            held = rng.randrange(blocks // 4, blocks + 1)  # a prefix of the prompt, as after eviction
            stored = [
                KVCacheStoredBlockData(h, array("i", tokens[i * BLOCK_SIZE : (i + 1) * BLOCK_SIZE]))
                for i, h in enumerate(hashes[:held])
            ]
            events.append(KVCacheEvent(event_id, KVCacheStoredData(None, stored), 8192))
        index.apply(EventBatch(f"engine-{w // 4}", events, attention_dp_size=4, producer_id=w))
    single, hashes_bodies = [], []
    queries_tokens = []
    for _ in range(queries):
        base = corpus[rng.randrange(prompts)]
        cut = rng.randrange(blocks // 2, blocks) * BLOCK_SIZE  # shares a prefix, then diverges
        tokens = base[:cut] + [rng.randrange(1, 50_000) for _ in range(blocks * BLOCK_SIZE - cut)]
        queries_tokens.append(tokens)
        single.append(json.dumps({"token_ids": tokens, "block_size": BLOCK_SIZE}).encode())
        hashes_bodies.append(json.dumps({"block_hashes": index.content_hashes(tokens, BLOCK_SIZE)}).encode())
    batch = [
        json.dumps(
            {
                "prompts": [{"token_ids": t} for t in queries_tokens[i : i + batch_size]],
                "block_size": BLOCK_SIZE,
            }
        ).encode()
        for i in range(0, len(queries_tokens) - batch_size + 1, batch_size)
    ]
    return Workload(index, single, hashes_bodies, batch, batch_size, blocks)
