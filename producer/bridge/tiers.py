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

from .hashes import NEW_MEDIUM_LEVEL_MAX

__all__ = ["TierChange", "TierMap", "block_key"]

BlockKey = int
"""``window_size << 64 | block_hash``: one int, not a tuple (no allocation to hash it, nothing for
the garbage collector to track in a map of a whole cache)."""


def block_key(window: int, block_hash: int) -> BlockKey:
    """The key of a block of ``window`` (>= 0) with the unsigned 64-bit ``block_hash``."""
    return window << 64 | block_hash


@dataclass(frozen=True, slots=True)
class TierChange:
    """What one engine store/remove means for the index: ``kind`` is ``stored`` (new entry at
    ``new_level``), ``updated`` (``old_level`` -> ``new_level``), ``removed`` or ``none``."""

    kind: str
    old_level: int | None = None
    new_level: int | None = None


_NONE = TierChange("none")
_U64 = (1 << 64) - 1


def _lowest(mask: int) -> int:
    """The lowest level in a level mask (bit ``i``: level ``i`` holds the block)."""
    return (mask & -mask).bit_length() - 1


@dataclass(slots=True)
class TierMap:
    """Per (window, block hash) (as :func:`block_key`): the levels (media) holding it, as a bit
    mask (bit ``i``: level ``i``). An int, not a set: no allocation for the common single-level
    block, and nothing for the garbage collector to walk in a map of a whole cache."""

    held: dict[BlockKey, int] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.held)

    def level(self, window: int, block_hash: int) -> int | None:
        mask = self.held.get(block_key(window, block_hash))
        return _lowest(mask) if mask else None

    def store(self, window: int, block_hash: int, level: int) -> TierChange:
        key = block_key(window, block_hash)
        mask = self.held.get(key)
        bit = 1 << level
        if not mask:
            self.held[key] = bit
            return TierChange("stored", None, level)
        if mask & bit:
            return _NONE
        old = _lowest(mask)
        self.held[key] = mask | bit
        return TierChange("updated", old, level) if level < old else _NONE

    def remove(self, window: int, block_hash: int, level: int) -> TierChange:
        key = block_key(window, block_hash)
        mask = self.held.get(key)
        bit = 1 << level
        if not mask or not mask & bit:
            return _NONE
        old = _lowest(mask)
        mask &= ~bit
        if not mask:
            del self.held[key]
            return TierChange("removed", old, None)
        self.held[key] = mask
        new = _lowest(mask)
        return TierChange("updated", old, new) if new != old else _NONE

    def knows(self, window: int, block_hash: int) -> bool:
        return block_key(window, block_hash) in self.held

    def clear(self) -> None:
        self.held.clear()

    def to_state(self) -> list[list[int]]:
        """Rows ``[window, hash, level, level, ...]`` (for the bridge's state file)."""
        return [[key >> 64, key & _U64, *_levels(mask)] for key, mask in self.held.items()]

    @classmethod
    def from_state(cls, rows: Iterable[list[int]]) -> TierMap:
        held: dict[BlockKey, int] = {}
        for r in rows:
            if len(r) > 2:
                held[block_key(int(r[0]), int(r[1]))] = sum({1 << saved_level(x) for x in r[2:]})
        return cls(held)


def saved_level(value: int) -> int:
    """A level from a state file: 0..NEW_MEDIUM_LEVEL_MAX (levels past it, from bridges before
    the media cap, are clamped as the media map's are); ValueError for a negative one."""
    level = int(value)
    if level < 0:
        raise ValueError(f"tier level {level} is negative")
    return min(level, NEW_MEDIUM_LEVEL_MAX)


def _levels(mask: int) -> list[int]:
    """The levels of a mask, lowest first."""
    out = []
    while mask:
        low = mask & -mask
        out.append(low.bit_length() - 1)
        mask ^= low
    return out
