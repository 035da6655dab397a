"""Matching with many workers per block: the compiled core's result templates stay exact.

A query matched by 32 or more window caches is answered from a cached template (see
``_indexcore.IndexCore.match_counts``); these tests change the holders between repeated
queries (removals, new holders, second windows, levels) and compare both cores every time.
"""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest
from _index_helpers import batch, created, removed, stored, updated
from kvevents.consumer.index import CacheIndex, compiled_core_available
from kvevents.schemas import KVCacheEvent

INSTANCES = 6
DP = 8
PROMPT = list(range(1000, 1032))
DOC = list(range(2000, 2064))


def _fleet() -> tuple[list[CacheIndex], dict[tuple[str, int], int], dict[str, int]]:
    if not compiled_core_available():
        pytest.fail("kvevents.consumer._indexcore is not built")
    indexes = [CacheIndex(core="python"), CacheIndex(core="compiled")]
    eids: dict[tuple[str, int], int] = {}
    seqs: dict[str, int] = {}
    for i in range(INSTANCES):
        inst = f"i{i}"
        events = [created(0, rank=r) for r in range(DP)]
        for r in range(DP):
            eids[(inst, r)] = 1
        for index in indexes:
            index.apply(batch(events, 0, inst, dp=DP))
        seqs[inst] = 1
    return indexes, eids, seqs


def _send(
    indexes: list[CacheIndex],
    eids: dict[tuple[str, int], int],
    seqs: dict[str, int],
    worker: tuple[str, int],
    make: Callable[[int, int], KVCacheEvent],
) -> None:
    inst, rank = worker
    event = make(eids[worker], rank)
    eids[worker] += 1
    for index in indexes:
        index.apply(batch([event], seqs[inst], inst, dp=DP))
    seqs[inst] += 1


def _check(indexes: list[CacheIndex], queries: list[list[int]]) -> int:
    python, compiled = indexes
    biggest = 0
    for q in queries:
        for kwargs in ({}, {"max_cache_level": 0}, {"window_size": 64}):
            expected = python.find_matches(q, **kwargs)  # type: ignore[arg-type]
            assert compiled.find_matches(q, **kwargs) == expected, (q[:3], kwargs)  # type: ignore[arg-type]
            biggest = max(biggest, len(expected))
    return biggest


@pytest.mark.parametrize("seed", range(4))
def test_repeated_queries_follow_every_change_of_the_holders(seed: int) -> None:
    rng = random.Random(seed)
    indexes, eids, seqs = _fleet()
    workers = [(f"i{i}", r) for i in range(INSTANCES) for r in range(DP)]
    own: dict[tuple[str, int], list[int]] = {}
    for n, worker in enumerate(workers):
        tail = [10_000 + 100 * n + k for k in range(rng.randint(1, 40))]
        chain = PROMPT + (DOC if rng.random() < 0.5 else []) + tail
        own[worker] = chain
        _send(indexes, eids, seqs, worker, lambda e, r, c=chain: stored(e, c, rank=r))
    queries = [PROMPT + DOC + own[w][len(PROMPT) + len(DOC) :] for w in workers[:8]]
    queries += [PROMPT[:5], [*PROMPT, 7], PROMPT + DOC, own[workers[3]]]
    assert _check(indexes, queries) == len(workers)  # the template path (>= 32 caches) is taken
    for _ in range(60):
        worker = rng.choice(workers)
        action = rng.random()
        h = rng.choice(PROMPT + DOC)
        if action < 0.3:  # a worker loses a block of the shared prefix (a hole mid-chain)
            _send(indexes, eids, seqs, worker, lambda e, r, h=h: removed(e, [h], rank=r))
        elif action < 0.55:  # it stores the prefix again
            _send(indexes, eids, seqs, worker, lambda e, r: stored(e, PROMPT + DOC, rank=r))
        elif action < 0.7:  # a block moves to the secondary level
            _send(indexes, eids, seqs, worker, lambda e, r, h=h: updated(e, h, level=(0, 1), rank=r))
        elif action < 0.8:  # a second window cache: the worker's best window counts
            _send(indexes, eids, seqs, worker, lambda e, r: stored(e, PROMPT[:20], window=128, rank=r))
        else:  # the worker is rebuilt empty
            _send(indexes, eids, seqs, worker, lambda e, r: created(e, rank=r))
        _check(indexes, queries)
