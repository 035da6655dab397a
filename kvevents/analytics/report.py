"""The cache report: what an operator wants to know about a stretch of a kvevents topic.

:class:`CacheReport` is fed :class:`~kvevents.analytics.source.Read` items in Kafka order (from
the topic or rebuilt from a Parquet export) and combines

- :class:`~kvevents.commands._stats.StreamStats` (``kvevents stats``): event counts and rates,
  prefix reuse across workers, block lifetimes, level moves, drops and gaps;
- a :class:`~kvevents.consumer.CacheIndex` replay: the hit rate a cache-aware router would get
  against round-robin (each Stored event scored, before it is applied, as a request for its
  block chain: the parents known so far (the 2-4M stored last; ``parents_forgotten`` counts
  those dropped), then its blocks; a cache-aware router takes the worker
  holding the longest leading run, round-robin any worker, i.e. the mean over workers; "observed"
  is the worker that did store it), and the time each worker spent degraded (from a loss the
  index detects until the Created event or snapshot that rebuilds it);
- eviction churn per tier (cache level of the block when it was removed, from its Stored and
  Updated events; "unknown" when it was stored before the range), per second over time.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from kvevents.consumer import CacheIndex, WorkerKey
from kvevents.schemas import (
    EventBatch,
    KVCacheCreatedData,
    KVCacheRemovedData,
    KVCacheStoredData,
    KVCacheUpdatedData,
    check_batch,
)

from kvevents.commands._bounded import RecentMap
from kvevents.commands._stats import STORERS_GENERATION, StreamStats

from .source import Read

__all__ = ["MAX_CHAIN_BLOCKS", "TIER_NAMES", "CacheReport", "tier_name"]

MAX_CHAIN_BLOCKS = 512
"""Longest block chain scored for a request (ancestors beyond it are not walked)."""
TIER_NAMES = {0: "primary (GPU)", 1: "secondary (host)"}
_TICK_US = 100_000


def tier_name(level: int | None) -> str:
    if level is None:
        return "unknown"
    return TIER_NAMES.get(level, f"level {level}")


@dataclass
class RoutingScore:
    """Blocks hit by each policy over the scored Stored events."""

    requests: int = 0
    blocks: int = 0
    hits: Counter[str] = field(default_factory=Counter)

    def rate(self, policy: str) -> float:
        return self.hits[policy] / self.blocks if self.blocks else 0.0


class CacheReport:
    """Aggregates over the items given to :meth:`add` (see the module docstring)."""

    def __init__(self, *, bucket_s: float = 1.0, malformed: int = 0) -> None:
        self.stats = StreamStats(bucket_s=bucket_s, malformed=malformed)
        self.index = CacheIndex()
        self.routing = RoutingScore()
        self.evictions: Counter[str] = Counter()
        self.evictions_per_tick: Counter[tuple[int, str]] = Counter()  # 100 ms ticks
        self.degraded_s: Counter[WorkerKey] = Counter()
        self.degraded_spells: Counter[WorkerKey] = Counter()
        self._levels: dict[WorkerKey, dict[tuple[int, int], int]] = {}  # (window, hash) -> level
        self._parents: RecentMap[int, int | None] = RecentMap(STORERS_GENERATION)  # the newest 2-4M
        self._degraded_since: dict[WorkerKey, int] = {}
        self._last_us = 0

    def add_all(self, reads: Iterable[Read]) -> CacheReport:
        for read in reads:
            self.add(read)
        return self

    def add(self, read: Read) -> None:
        """Count one batch; :class:`~kvevents.schemas.LimitError`, and nothing counted, for a
        batch the index refuses (one that decodes but breaks its limits: a rank outside
        ``attention_dp_size``, too many events...), which would otherwise stop the report."""
        batch, time_us = read.batch, read.time_us
        check_batch(batch, self.index.limits)
        self.stats.add(batch, time_us)
        self._score_routing(batch)
        self._track_levels(batch, time_us)
        gaps = self.index.counters()["gaps"]
        self.index.apply(batch)
        self._track_degraded(batch, gaps != self.index.counters()["gaps"], time_us)

    # ------------------------------------------------------------------ routing

    def _chain(self, parent: int | None) -> list[int]:
        ancestors: list[int] = []
        parents = self._parents
        while parent is not None and len(ancestors) < MAX_CHAIN_BLOCKS:
            ancestors.append(parent)
            parent = parents.get(parent)
        ancestors.reverse()
        return ancestors

    def _score_routing(self, batch: EventBatch) -> None:
        workers = self.index.worker_count()  # before this batch is applied
        for event in batch.events:
            data = event.data
            if not isinstance(data, KVCacheStoredData) or not data.blocks:
                continue
            hashes = [block.block_hash for block in data.blocks]
            chain = (self._chain(data.parent_hash) + hashes)[-MAX_CHAIN_BLOCKS:]
            parent = data.parent_hash
            for h in hashes:
                self._parents[h] = parent
                parent = h
            if not workers:
                continue
            matches = self.index.find_matches(chain, event.window_size)
            me = WorkerKey(batch.instance_id, event.attention_dp_rank or 0)
            score = self.routing
            score.requests += 1
            score.blocks += len(chain)
            score.hits["cache_aware"] += max(matches.values(), default=0)
            score.hits["round_robin"] += sum(matches.values()) / workers  # type: ignore[assignment]
            score.hits["observed"] += matches.get(me, 0)

    # ------------------------------------------------------------------ tiers

    def _track_levels(self, batch: EventBatch, time_us: int) -> None:
        tick = time_us // _TICK_US
        for event in batch.events:
            worker = WorkerKey(batch.instance_id, event.attention_dp_rank or 0)
            window = event.window_size
            data = event.data
            if isinstance(data, KVCacheCreatedData):
                self._levels.pop(worker, None)
                continue
            levels = self._levels.setdefault(worker, {})
            if isinstance(data, KVCacheStoredData):
                for block in data.blocks:
                    levels[(window, block.block_hash)] = block.cache_level
            elif isinstance(data, KVCacheRemovedData):
                for h in data.block_hashes:
                    tier = tier_name(levels.pop((window, h), None))
                    self.evictions[tier] += 1
                    self.evictions_per_tick[(tick, tier)] += 1
            elif isinstance(data, KVCacheUpdatedData) and data.cache_level is not None:
                levels[(window, data.block_hash)] = data.cache_level.new_value

    # ------------------------------------------------------------------ loss

    def _track_degraded(self, batch: EventBatch, degraded_more: bool, time_us: int) -> None:
        """Spells of the batch's instance's workers: only a batch of its own instance degrades a
        worker (every rank, on a sequence gap) or heals it (its Created event), so only the ranks
        the batch names are looked at, or all of the instance's when the index counted a gap."""
        instance = batch.instance_id
        if degraded_more:
            workers = self.index.workers_of([instance])
        else:
            named = {event.attention_dp_rank or 0 for event in batch.events}
            named.update(drop.attention_dp_rank for drop in batch.dropped)
            workers = [WorkerKey(instance, rank) for rank in sorted(named)]
        since = self._degraded_since
        for worker in workers:
            try:
                degraded = self.index.is_degraded(worker)
            except KeyError:  # named, but the index keeps no worker for it
                continue
            if degraded and worker not in since:
                since[worker] = time_us
                self.degraded_spells[worker] += 1
            elif not degraded and worker in since:
                self.degraded_s[worker] += max(0, time_us - since.pop(worker)) / 1e6  # type: ignore[assignment]
        self._last_us = max(self._last_us, time_us)

    def degraded_seconds(self) -> dict[WorkerKey, float]:
        """Per worker, seconds degraded (a spell still open counts until the last batch)."""
        result = {w: float(s) for w, s in self.degraded_s.items()}
        for worker, started in self._degraded_since.items():
            result[worker] = result.get(worker, 0.0) + max(0, self._last_us - started) / 1e6
        return result

    # ------------------------------------------------------------------ output

    def eviction_series(self, bucket_s: float) -> tuple[list[float], dict[str, list[float]]]:
        """Bucket start times (seconds from the first eviction) and evictions/s per tier per
        bucket (``bucket_s`` a multiple of 0.1 s)."""
        if not self.evictions_per_tick:
            return [], {}
        ticks_per_bucket = max(1, round(bucket_s * 1e6 / _TICK_US))
        first = min(t for t, _ in self.evictions_per_tick)
        count = (max(t for t, _ in self.evictions_per_tick) - first) // ticks_per_bucket + 1
        width = ticks_per_bucket * _TICK_US / 1e6
        series = {tier: [0.0] * count for tier in self.evictions}
        for (tick, tier), n in self.evictions_per_tick.items():
            series[tier][(tick - first) // ticks_per_bucket] += n / width
        return [i * width for i in range(count)], series

    def to_json(self) -> dict[str, Any]:
        """Every section as a JSON-ready dict."""
        base = self.stats.to_json()
        span = base["range"]["seconds"] or 0.0
        degraded = self.degraded_seconds()
        workers = self.index.workers()
        drops = Counter({WorkerKey(*w): n for w, n in self.stats.drops.items()})
        return {
            "range": base["range"],
            "events": base["events"],
            "rates_per_s": base["rates_per_s"],
            "workers": [f"{w.instance_id}/{w.attention_dp_rank}" for w in workers],
            "prefix_reuse": base["prefix_reuse"],
            "block_lifetimes": base["block_lifetimes"],
            "tiers": {
                "evictions": dict(sorted(self.evictions.items())),
                "evictions_per_s": {
                    t: round(n / span, 3) if span else 0.0 for t, n in sorted(self.evictions.items())
                },
                "offloads_primary_to_secondary": base["level_moves"]["primary_to_secondary"],
                "onboards_secondary_to_primary": base["level_moves"]["secondary_to_primary"],
            },
            "routing": {
                "requests_scored": self.routing.requests,
                "parents_forgotten": self._parents.forgotten,
                "chain_blocks": self.routing.blocks,
                "hit_rate": {
                    p: round(self.routing.rate(p), 4) for p in ("cache_aware", "round_robin", "observed")
                },
            },
            "loss": {
                "dropped_events": base["drops_and_gaps"]["dropped_events"],
                "missing_batches": base["drops_and_gaps"]["missing_batches"],
                "event_ids_skipped": base["drops_and_gaps"]["event_ids_skipped"],
                "malformed_messages": base["drops_and_gaps"]["malformed_messages"],
                "by_worker": {
                    f"{w.instance_id}/{w.attention_dp_rank}": {
                        "dropped_events": drops.get(w, 0),
                        "degraded_spells": self.degraded_spells.get(w, 0),
                        "degraded_s": round(degraded.get(w, 0.0), 3),
                        "degraded_share": round(degraded.get(w, 0.0) / span, 4) if span else 0.0,
                        "degraded_now": w in self._degraded_since,
                    }
                    for w in workers
                },
            },
        }
