"""Analytics over a stretch of the events topic, for ``kvevents stats``: fed batches with
their time, :class:`StreamStats` counts

- **rates**: events per type over the whole range and per time bucket;
- **cache-level moves**: Updated events changing a block's level (0->1 offload, 1->0 onboard,
  others), and priority changes;
- **block lifetimes**: seconds from a block's Stored event to its Removed event on the same
  worker and window (a Created event of the worker ends its blocks without a lifetime);
- **prefix reuse**: Stored blocks whose hash another worker had already stored, and Stored
  events whose parent block another worker had stored (engine hashes: meaningful across
  workers when the engine's hashes are deterministic, as TensorRT-LLM's and the simulator's);
- **drops and gaps**: events dropped in-band per worker, jumps of an instance's batch
  sequence, jumps of a worker's event ids, replays; malformed messages.

Memory stays bounded over any range (``_bounded``): lifetime percentiles come from a uniform
sample of ``LIFETIME_SAMPLE`` lifetimes past that many (count, mean and max stay exact), and
prefix reuse remembers the block hashes stored most recently, 2-4M of them (how many it
forgot is reported: reuse of a forgotten block is not counted).
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any

from kvevents.schemas import (
    EventBatch,
    KVCacheCreatedData,
    KVCacheRemovedData,
    KVCacheStoredData,
    KVCacheUpdatedData,
)

from kvevents.commands._bounded import RecentMap, Reservoir

__all__ = ["StreamStats", "percentile"]

LIFETIME_SAMPLE = 1_000_000
"""Lifetimes kept exactly; past it, a uniform sample of this many."""
STORERS_GENERATION = 2_000_000
"""Block hashes per generation of the prefix-reuse memory (at most two are kept)."""
MAX_SERIES_POINTS = 100_000
"""At most this many points in a rates-over-time series (coarser buckets past it)."""

TYPES = ("created", "stored", "removed", "updated")
Worker = tuple[str, int]


def percentile(sorted_values: list[float], q: float) -> float:
    """The ``q`` (0..100) percentile of sorted values, linear between ranks (0.0 when empty)."""
    if not sorted_values:
        return 0.0
    position = (len(sorted_values) - 1) * q / 100.0
    low = math.floor(position)
    high = min(low + 1, len(sorted_values) - 1)
    return sorted_values[low] + (sorted_values[high] - sorted_values[low]) * (position - low)


@dataclass
class StreamStats:
    """Counts over the batches given to :meth:`add` (see the module docstring)."""

    bucket_s: float = 1.0
    batches: int = 0
    bytes: int = 0
    malformed: int = 0
    first_us: int | None = None
    last_us: int | None = None
    events: Counter[str] = field(default_factory=Counter)
    stored_blocks: int = 0
    removed_blocks: int = 0
    buckets: dict[int, Counter[str]] = field(default_factory=lambda: defaultdict(Counter))
    level_moves: Counter[tuple[int, int]] = field(default_factory=Counter)
    priority_changes: int = 0
    lifetimes_s: Reservoir = field(default_factory=lambda: Reservoir(LIFETIME_SAMPLE))
    removed_unseen: int = 0
    """Removed blocks whose Stored event is before the range (no lifetime)."""
    ended_by_created: int = 0
    shared_blocks: int = 0
    restored_blocks: int = 0
    """Blocks a worker stored again that it had stored before (in the range)."""
    parent_from_other: int = 0
    stored_with_parent: int = 0
    drops: Counter[Worker] = field(default_factory=Counter)
    sequence_gaps: Counter[str] = field(default_factory=Counter)
    """Per instance: batches missing between consecutive sequence numbers."""
    producer_changes: Counter[str] = field(default_factory=Counter)
    replayed_batches: int = 0
    event_id_gaps: Counter[Worker] = field(default_factory=Counter)
    """Per worker: event ids skipped."""
    replayed_events: int = 0
    _stored_at: dict[Worker, dict[tuple[int, int], int]] = field(default_factory=dict, repr=False)
    """Per worker, (window, block hash) -> when stored: a Created event drops its worker's map."""
    _storers: RecentMap[int, Any] = field(default_factory=lambda: RecentMap(STORERS_GENERATION), repr=False)
    _sequence: dict[str, tuple[int, int]] = field(default_factory=dict, repr=False)
    _cursor: dict[Worker, int] = field(default_factory=dict, repr=False)

    def add(self, batch: EventBatch, time_us: int, size: int = 0) -> None:
        """Count one batch made at ``time_us``."""
        self.batches += 1
        self.bytes += size
        if time_us > 0:
            self.first_us = time_us if self.first_us is None else min(self.first_us, time_us)
            self.last_us = time_us if self.last_us is None else max(self.last_us, time_us)
        replay = self._batch_envelope(batch)
        if replay:
            self.replayed_batches += 1
        bucket = self.buckets[int(time_us // (self.bucket_s * 1e6))] if time_us > 0 else None
        for event in batch.events:
            worker = (batch.instance_id, 0 if event.attention_dp_rank is None else event.attention_dp_rank)
            if not self._new_event(worker, event.event_id, batch, event is batch.events[0]):
                self.replayed_events += 1
                continue
            kind = self._apply(worker, event.window_size, event.data, time_us)
            self.events[kind] += 1
            if bucket is not None:
                bucket[kind] += 1

    def _batch_envelope(self, batch: EventBatch) -> bool:
        """Sequence gaps and drops; True when the batch is a replay (its drops not counted)."""
        previous = self._sequence.get(batch.instance_id)
        replay = False
        if previous is not None:
            if previous[0] != batch.producer_id:
                self.producer_changes[batch.instance_id] += 1
            elif batch.sequence <= previous[1]:
                replay = True
            elif batch.sequence > previous[1] + 1:
                self.sequence_gaps[batch.instance_id] += batch.sequence - previous[1] - 1
        if not replay:
            self._sequence[batch.instance_id] = (batch.producer_id, batch.sequence)
            for drop in batch.dropped:
                if drop.dropped_events > 0:
                    self.drops[(batch.instance_id, drop.attention_dp_rank)] += drop.dropped_events
        return replay

    def _new_event(self, worker: Worker, event_id: int, batch: EventBatch, first: bool) -> bool:
        cursor = self._cursor.get(worker)
        if cursor is not None:
            if event_id == cursor and first and batch.first_event_block_offset > 0:
                return True  # the rest of a split Stored event
            if event_id <= cursor:
                return False
            if event_id > cursor + 1:
                self.event_id_gaps[worker] += event_id - cursor - 1
        self._cursor[worker] = event_id
        return True

    def _apply(self, worker: Worker, window: int, data: Any, time_us: int) -> str:
        if isinstance(data, KVCacheStoredData):
            if data.parent_hash is not None:
                self.stored_with_parent += 1
                if self._stored_by_other(data.parent_hash, worker):
                    self.parent_from_other += 1
            held = self._stored_at.setdefault(worker, {})
            for block in data.blocks:
                self.stored_blocks += 1
                held.setdefault((window, block.block_hash), time_us)
                self._note_storer(block.block_hash, worker)
            return "stored"
        if isinstance(data, KVCacheRemovedData):
            held = self._stored_at.get(worker, {})
            for block_hash in data.block_hashes:
                self.removed_blocks += 1
                stored = held.pop((window, block_hash), None)
                if stored is None or stored <= 0 or time_us <= 0:
                    self.removed_unseen += 1
                else:
                    self.lifetimes_s.add(max(0, time_us - stored) / 1e6)
            return "removed"
        if isinstance(data, KVCacheUpdatedData):
            if data.cache_level is not None and data.cache_level.old_value != data.cache_level.new_value:
                self.level_moves[(data.cache_level.old_value, data.cache_level.new_value)] += 1
            if data.priority is not None and data.priority.old_value != data.priority.new_value:
                self.priority_changes += 1
            return "updated"
        assert isinstance(data, KVCacheCreatedData)
        self.ended_by_created += len(self._stored_at.pop(worker, ()))
        return "created"

    def _stored_by_other(self, block_hash: int, worker: Worker) -> bool:
        storers = self._storers.get(block_hash)
        if storers is None:
            return False
        if isinstance(storers, set):
            return bool(storers - {worker})
        return bool(storers != worker)

    def _note_storer(self, block_hash: int, worker: Worker) -> None:
        storers = self._storers.get(block_hash)
        if storers is None:
            self._storers[block_hash] = worker
            return
        if self._stored_by_other(block_hash, worker):
            self.shared_blocks += 1
        elif storers == worker or (isinstance(storers, set) and worker in storers):
            self.restored_blocks += 1
        if isinstance(storers, set):
            storers.add(worker)
        elif storers != worker:
            storers = {storers, worker}
        self._storers[block_hash] = storers  # written again: recent, kept in the current generation

    # ------------------------------------------------------------------ results

    @property
    def span_s(self) -> float:
        """Seconds between the first and the last batch's time."""
        if self.first_us is None or self.last_us is None:
            return 0.0
        return (self.last_us - self.first_us) / 1e6

    def rates(self) -> dict[str, float]:
        """Events per second per type over the span (over one bucket when the span is shorter)."""
        span = max(self.span_s, self.bucket_s) if self.first_us is not None else 0.0
        return {t: (self.events[t] / span if span else 0.0) for t in TYPES}

    def series_step(self) -> int:
        """Buckets per point of :meth:`series`: 1, or more when the span holds more than
        ``MAX_SERIES_POINTS`` buckets (two batches 2**44 us apart with ``--bucket 1`` made 17.6M
        points: 45 s and 3.7 GB)."""
        if not self.buckets:
            return 1
        n = max(self.buckets) - min(self.buckets) + 1
        return -(-n // MAX_SERIES_POINTS)

    def series(self) -> tuple[list[float], dict[str, list[float]]]:
        """Point start times (seconds since the first bucket) and events/s per type per point:
        a bucket each, or ``series_step()`` buckets merged."""
        if not self.buckets:
            return [], {t: [] for t in TYPES}
        first, last, step = min(self.buckets), max(self.buckets), self.series_step()
        width = self.bucket_s * step
        points: dict[int, Counter[str]] = defaultdict(Counter)
        for b, counts in self.buckets.items():
            points[(b - first) // step].update(counts)
        n = (last - first) // step + 1
        times = [k * width for k in range(n)]
        rates = {t: [points[k][t] / width if k in points else 0.0 for k in range(n)] for t in TYPES}
        return times, rates

    def lifetime_summary(self) -> dict[str, float | int | bool]:
        lifetimes = self.lifetimes_s
        values = sorted(lifetimes)
        return {
            "count": lifetimes.count,
            "p50_s": round(percentile(values, 50), 6),
            "p90_s": round(percentile(values, 90), 6),
            "p99_s": round(percentile(values, 99), 6),
            "max_s": round(lifetimes.max or 0.0, 6),
            "mean_s": round(lifetimes.total / lifetimes.count, 6) if lifetimes.count else 0.0,
            "percentiles_sampled": lifetimes.sampled,
            "removed_without_store_in_range": self.removed_unseen,
            "ended_by_created": self.ended_by_created,
            "still_held": sum(map(len, self._stored_at.values())),
        }

    def to_json(self) -> dict[str, Any]:
        """Everything as a JSON-ready dict."""
        moves = {f"{a}->{b}": n for (a, b), n in sorted(self.level_moves.items())}
        return {
            "range": {
                "first_us": self.first_us,
                "last_us": self.last_us,
                "seconds": round(self.span_s, 6),
                "batches": self.batches,
                "bytes": self.bytes,
                "malformed": self.malformed,
            },
            "events": {t: self.events[t] for t in TYPES},
            "rates_per_s": {t: round(r, 3) for t, r in self.rates().items()},
            "blocks": {"stored": self.stored_blocks, "removed": self.removed_blocks},
            "level_moves": {
                "primary_to_secondary": self.level_moves[(0, 1)],
                "secondary_to_primary": self.level_moves[(1, 0)],
                "all": moves,
                "priority_changes": self.priority_changes,
            },
            "block_lifetimes": self.lifetime_summary(),
            "prefix_reuse": {
                "stored_blocks": self.stored_blocks,
                "already_stored_by_another_worker": self.shared_blocks,
                "stored_again_by_the_same_worker": self.restored_blocks,
                "share": round(self.shared_blocks / self.stored_blocks, 4) if self.stored_blocks else 0.0,
                "stored_events_with_parent": self.stored_with_parent,
                "parent_stored_by_another_worker": self.parent_from_other,
                "block_hashes_forgotten": self._storers.forgotten,
            },
            "drops_and_gaps": {
                "dropped_events": sum(self.drops.values()),
                "dropped_by_worker": {f"{i}/{r}": n for (i, r), n in sorted(self.drops.items())},
                "missing_batches": sum(self.sequence_gaps.values()),
                "missing_batches_by_instance": dict(sorted(self.sequence_gaps.items())),
                "producer_changes": dict(sorted(self.producer_changes.items())),
                "replayed_batches": self.replayed_batches,
                "event_ids_skipped": sum(self.event_id_gaps.values()),
                "event_ids_skipped_by_worker": {
                    f"{i}/{r}": n for (i, r), n in sorted(self.event_id_gaps.items())
                },
                "replayed_events": self.replayed_events,
                "malformed_messages": self.malformed,
            },
        }
