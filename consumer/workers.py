"""Who holds KV blocks: worker keys, and the per-worker statistics the index reports."""

from __future__ import annotations

from typing import NamedTuple

import msgspec

__all__ = ["BlockEntry", "WindowStats", "WorkerKey", "WorkerStats"]


class WorkerKey(NamedTuple):
    """One KV cache: an engine instance's attention-DP rank (0 when the engine has no attention DP).

    Events whose ``attention_dp_rank`` is None belong to rank 0.
    """

    instance_id: str
    attention_dp_rank: int


class BlockEntry(NamedTuple):
    """One block as one worker holds it: engine hash, content hash (None for an orphan whose
    prefix the index never saw), cache level and priority."""

    block_hash: int
    content_hash: int | None
    cache_level: int
    priority: int


class WindowStats(msgspec.Struct, frozen=True):
    """One window size's cache of one worker.

    ``capacity`` is the ``num_blocks_per_cache_level`` of the Created event that made this cache
    (None when its blocks arrived without one); ``blocks_by_level`` counts held blocks per
    cache level (levels with no block are omitted).
    """

    window_size: int
    blocks: int
    blocks_by_level: dict[int, int]
    capacity: tuple[int, ...] | None = None


class WorkerStats(msgspec.Struct, frozen=True):
    """What the index knows about one worker.

    ``degraded`` is True while the worker's view may be incomplete (events lost or unseen);
    ``degraded_reasons`` says why, oldest first, until a Created event or a snapshot rebuilds
    it. ``last_event_id`` is the id of the last event applied (None before any);
    ``producer_id`` and ``last_batch_sequence`` are those of the instance's current producer.
    """

    key: WorkerKey
    degraded: bool
    degraded_reasons: tuple[str, ...]
    last_event_id: int | None
    producer_id: int | None
    last_batch_sequence: int | None
    windows: dict[int, WindowStats]

    @property
    def blocks(self) -> int:
        """Blocks held over every window size and cache level."""
        return sum(w.blocks for w in self.windows.values())

    @property
    def blocks_by_level(self) -> dict[int, int]:
        """Blocks held per cache level, summed over window sizes."""
        total: dict[int, int] = {}
        for window in self.windows.values():
            for level, count in window.blocks_by_level.items():
                total[level] = total.get(level, 0) + count
        return total
