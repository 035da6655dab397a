"""Which media hold each block, so that tier moves become level changes, not deletions.

An engine reports a block on GPU and CPU as two Stored events and a move as a Removed on one
medium plus a Stored on another. kvevents keeps ONE entry per block whose ``cache_level`` is the
best (lowest) level any medium holds; :class:`TierMap` turns the engine's per-medium events into
that: Stored when the first medium gets it, Updated when the best level changes, Removed when
the last medium lets it go.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

__all__ = ["TierChange", "TierMap"]

BlockKey = tuple[int, int]  # (window_size, block_hash)


@dataclass(frozen=True, slots=True)
class TierChange:
    """What one engine store/remove means for the index: ``kind`` is ``stored`` (new entry at
    ``new_level``), ``updated`` (``old_level`` -> ``new_level``), ``removed`` or ``none``."""

    kind: str
    old_level: int | None = None
    new_level: int | None = None


_NONE = TierChange("none")


@dataclass(slots=True)
class TierMap:
    """Per (window, block hash): the set of levels (media) holding it."""

    held: dict[BlockKey, set[int]] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.held)

    def level(self, window: int, block_hash: int) -> int | None:
        levels = self.held.get((window, block_hash))
        return min(levels) if levels else None

    def store(self, window: int, block_hash: int, level: int) -> TierChange:
        key = (window, block_hash)
        levels = self.held.get(key)
        if not levels:
            self.held[key] = {level}
            return TierChange("stored", None, level)
        if level in levels:
            return _NONE
        old = min(levels)
        levels.add(level)
        return TierChange("updated", old, level) if level < old else _NONE

    def remove(self, window: int, block_hash: int, level: int) -> TierChange:
        key = (window, block_hash)
        levels = self.held.get(key)
        if not levels or level not in levels:
            return _NONE
        old = min(levels)
        levels.discard(level)
        if not levels:
            del self.held[key]
            return TierChange("removed", old, None)
        new = min(levels)
        return TierChange("updated", old, new) if new != old else _NONE

    def knows(self, window: int, block_hash: int) -> bool:
        return (window, block_hash) in self.held

    def clear(self) -> None:
        self.held.clear()

    def to_state(self) -> list[list[int]]:
        """Rows ``[window, hash, level, level, ...]`` (for the bridge's state file)."""
        return [[w, h, *sorted(levels)] for (w, h), levels in self.held.items()]

    @classmethod
    def from_state(cls, rows: Iterable[list[int]]) -> TierMap:
        return cls({(int(r[0]), int(r[1])): {int(x) for x in r[2:]} for r in rows if len(r) > 2})
