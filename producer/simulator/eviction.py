"""The simulated cache's radix tree nodes, and its eviction order: per cache level, the
unreferenced leaves by lowest retention priority, then least recently used."""

from __future__ import annotations

import heapq
from array import array

from kvevents.schemas import PRIMARY_LEVEL

__all__ = ["CachedBlock", "EvictionQueue"]

_heappush = heapq.heappush
_heappop = heapq.heappop


class CachedBlock:
    """A cached block: a node of the radix tree."""

    __slots__ = (
        "alive",
        "block_hash",
        "children",
        "last_used",
        "level",
        "lora_id",
        "parent",
        "primary_children",
        "priority",
        "ref_count",
        "tokens",
    )

    def __init__(
        self,
        block_hash: int,
        parent: CachedBlock | None,
        tokens: array[int],
        lora_id: int | None,
        priority: int,
    ) -> None:
        self.block_hash = block_hash
        self.parent = parent
        self.tokens = tokens
        self.lora_id = lora_id
        self.priority = priority
        self.level = PRIMARY_LEVEL
        self.ref_count = 0
        self.last_used = 0
        # a dict, not a set: a subtree is removed in the order its branches were stored, not
        # in the order of their memory addresses (the stream repeats exactly for one seed)
        self.children: dict[CachedBlock, None] = {}
        self.primary_children = 0
        self.alive = True

    def is_leaf_at(self, level: int) -> bool:
        # Invariant: a child's level is never below its parent's, so a secondary block's
        # children are all in secondary memory.
        return self.primary_children == 0 if level == PRIMARY_LEVEL else not self.children


_Entry = tuple[int, int, int, CachedBlock]


class EvictionQueue:
    """Eviction candidates per cache level, as lazy heaps: a block is pushed whenever it may
    have become evictable (unreferenced leaf) and checked when popped, so entries that went
    stale (referenced again, re-prioritised, used, moved or gone) are skipped. A heap is
    compacted when it grows past ``compact_above`` entries."""

    def __init__(self, compact_above: int) -> None:
        self._heaps: list[list[_Entry]] = [[], []]
        self._push_count = 0
        self._compact_above = compact_above

    def push(self, b: CachedBlock) -> None:
        """Make ``b`` a candidate if it is an unreferenced leaf at its level."""
        # b.is_leaf_at(b.level), inline: the simulator's hottest call (several per eviction)
        if b.ref_count == 0 and (
            b.primary_children == 0 if (level := b.level) == PRIMARY_LEVEL else not b.children
        ):
            self._push_count += 1
            heap = self._heaps[level]
            _heappush(heap, (b.priority, b.last_used, self._push_count, b))
            if len(heap) > self._compact_above:
                self._compact(level)

    def _valid(self, entry: _Entry, level: int) -> bool:
        priority, last_used, _, b = entry
        return (
            b.alive
            and b.level == level
            and b.ref_count == 0
            and b.priority == priority
            and b.last_used == last_used
            and b.is_leaf_at(level)
        )

    def _compact(self, level: int) -> None:
        seen: set[int] = set()
        kept = []
        for entry in self._heaps[level]:
            if self._valid(entry, level) and id(entry[3]) not in seen:
                seen.add(id(entry[3]))
                kept.append(entry)
        heapq.heapify(kept)
        self._heaps[level] = kept

    def pop(self, level: int) -> CachedBlock | None:
        """The next victim at ``level`` (lowest priority, least recently used), or None."""
        heap = self._heaps[level]
        while heap:
            priority, last_used, _, b = _heappop(heap)
            if (  # self._valid(entry, level), inline
                b.alive
                and b.level == level
                and b.ref_count == 0
                and b.priority == priority
                and b.last_used == last_used
                and (b.primary_children == 0 if level == PRIMARY_LEVEL else not b.children)
            ):
                return b
        return None
