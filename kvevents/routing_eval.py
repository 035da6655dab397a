"""Routing quality on held-out requests: prefix-cache hits when a router uses the index.

For each held-out request a policy picks one worker; the request's *true* hit on that worker
is how many leading reusable blocks of its prompt the worker's cache holds according to the
simulators' ground truth (what :meth:`EngineSimulator.reusable_blocks` would say: at most
``(len(prompt) - 1) // block_size`` blocks, any cache level). A policy's hit rate is the sum of
true hits over the sum of reusable blocks. Policies:

- ``index``: the worker with the most matching leading blocks in the rebuilt
  :class:`~kvevents.consumer.CacheIndex` (``find_matches`` on the engine's block hashes);
  ties, and requests no worker matches, go round-robin among the tied workers (request
  ``i`` takes tied worker ``i mod ties``);
- ``round_robin``: workers in turn; ``random``: a seeded uniform choice;
- ``oracle``: the best true hit (an upper bound, from the ground truth itself).

The evaluation is static: every request is scored against the caches as they were at the end
of the run (admitting one would change them; the held-out requests are independent samples).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvevents.consumer import CacheIndex, WorkerKey
    from kvevents.producer.simulator import GroundTruth
    from kvevents.producer.simulator.workload import Request

__all__ = ["POLICIES", "RoutingResult", "evaluate_routing"]

POLICIES = ("index", "round_robin", "random", "oracle")


@dataclass(frozen=True)
class RoutingResult:
    """Hit rates per policy over ``requests`` held-out requests (``reusable_blocks`` in all)."""

    requests: int
    reusable_blocks: int
    hit_blocks: dict[str, int]

    def hit_rate(self, policy: str) -> float:
        return self.hit_blocks[policy] / self.reusable_blocks if self.reusable_blocks else 0.0

    def to_json(self) -> dict[str, Any]:
        return {
            "requests": self.requests,
            "reusable_blocks": self.reusable_blocks,
            "hit_blocks": dict(self.hit_blocks),
            "hit_rate": {p: round(self.hit_rate(p), 4) for p in self.hit_blocks},
        }


def _reusable_hashes(request: Request, block_size: int) -> list[int]:
    from kvevents.producer.simulator.cache import block_hashes

    limit = (len(request.prompt) - 1) // block_size
    return block_hashes(request.prompt, block_size, request.lora_id, max_blocks=limit)


def evaluate_routing(
    index: CacheIndex, truths: Sequence[GroundTruth], requests: Sequence[Request], *, seed: int = 0
) -> RoutingResult:
    """Score every policy on ``requests`` (see the module docstring). All workers of
    ``truths`` are candidates; they must share one block size and window size."""
    from kvevents.consumer import WorkerKey
    from kvevents.producer.simulator import held_prefix_length

    if not truths:
        raise ValueError("routing needs at least one worker's ground truth")
    block_sizes = {t.block_size for t in truths}
    if len(block_sizes) != 1:
        raise ValueError(f"the workers use different block sizes {sorted(block_sizes)}")
    block_size = block_sizes.pop()
    workers: list[WorkerKey] = [WorkerKey(t.instance_id, t.attention_dp_rank or 0) for t in truths]
    held = {
        key: frozenset(next(iter(t.windows.values()), {}).keys())
        for key, t in zip(workers, truths, strict=True)
    }
    rng = random.Random(seed)
    reusable = 0
    hits = dict.fromkeys(POLICIES, 0)
    for i, request in enumerate(requests):
        hashes = _reusable_hashes(request, block_size)
        reusable += len(hashes)
        truth_hits = {key: held_prefix_length(hashes, held[key]) for key in workers}
        matches = index.find_matches(hashes) if hashes else {}
        best = max((matches.get(key, 0) for key in workers), default=0)
        tied = [key for key in workers if matches.get(key, 0) == best]
        chosen = tied[i % len(tied)]
        hits["index"] += truth_hits[chosen]
        hits["round_robin"] += truth_hits[workers[i % len(workers)]]
        hits["random"] += truth_hits[rng.choice(workers)]
        hits["oracle"] += max(truth_hits.values())
    return RoutingResult(len(requests), reusable, hits)
