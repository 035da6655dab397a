"""Producer snapshots: an engine re-publishes one rank's whole KV cache after a loss.

A snapshot is one ``Created`` event (``snapshot=True``) per window size, then Stored events
restoring every held block, parents first, one event per chain of the held prefix tree. This
module turns the engine's held blocks (in any order) into those chains; the manager's
:meth:`~kvevents.producer.KVCacheEventManager.enqueue_snapshot` queues them. Why and how
consumers apply it: ``docs/OPERATIONS.md``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from .block import BlockInfo

__all__ = ["SnapshotSummary", "snapshot_chains"]


@dataclass(frozen=True, slots=True)
class SnapshotSummary:
    """What :meth:`KVCacheEventManager.enqueue_snapshot` queued.

    ``first_event_id`` .. ``last_event_id`` are the snapshot's event ids (its first Created
    event and its last event); ``windows`` the window sizes re-created, in order;
    ``stored_events`` and ``blocks`` the Stored events and the blocks they carry.
    """

    first_event_id: int
    last_event_id: int
    windows: tuple[int, ...]
    stored_events: int
    blocks: int

    @property
    def events(self) -> int:
        """Every event of the snapshot (Created and Stored)."""
        return self.last_event_id - self.first_event_id + 1


def snapshot_chains(blocks: Iterable[BlockInfo]) -> list[tuple[BlockInfo, ...]]:
    """The held blocks of one window as Stored-event chains, parents first.

    ``blocks`` may come in any order; each block's parent is its ``prev_block_hash``. A block
    whose parent is not among ``blocks`` (None, or not held) starts a chain whose Stored event
    names that parent, exactly as the engine's own event did. Each chain follows the first
    child of each block (in input order) as far as it goes; other children start chains of
    their own, which come after their parent's chain. Raises ``ValueError`` for a block hash
    given twice or for blocks whose parent links form a cycle.
    """
    by_hash: dict[int, BlockInfo] = {}
    for block in blocks:
        if block.__class__ is not BlockInfo:
            raise TypeError(f"a snapshot takes BlockInfo objects, got {block!r}")
        if block.block_hash in by_hash:
            raise ValueError(f"block hash {block.block_hash} is given twice in one window's snapshot")
        by_hash[block.block_hash] = block
    children: dict[int, list[BlockInfo]] = {}
    starts: list[BlockInfo] = []
    for block in by_hash.values():
        parent = block.prev_block_hash
        if parent is not None and parent in by_hash and parent != block.block_hash:
            children.setdefault(parent, []).append(block)
        else:
            starts.append(block)
    chains: list[tuple[BlockInfo, ...]] = []
    pending = starts[::-1]  # a stack: the first start is taken first
    placed = 0
    while pending:
        block = pending.pop()
        chain = [block]
        while True:
            kids = children.get(block.block_hash)
            if not kids:
                break
            pending.extend(kids[:0:-1])  # siblings wait until this chain (their parent) is out
            block = kids[0]
            chain.append(block)
        placed += len(chain)
        chains.append(tuple(chain))
    if placed != len(by_hash):
        reached = {b.block_hash for chain in chains for b in chain}
        cycle = sorted(h for h in by_hash if h not in reached)
        raise ValueError(
            f"{len(cycle)} blocks are their own ancestors (a cycle of prev_block_hash links), e.g. {cycle[:4]}"
        )
    return chains


def capacities_by_window(
    windows: Sequence[int], num_blocks_per_cache_level: Mapping[int, Sequence[int]] | Sequence[int]
) -> dict[int, list[int]]:
    """Each window's ``num_blocks_per_cache_level``: one list for all, or a mapping per window
    (which must name every window that has blocks; windows only in the mapping are added)."""
    if isinstance(num_blocks_per_cache_level, Mapping):
        missing = [w for w in windows if w not in num_blocks_per_cache_level]
        if missing:
            raise ValueError(f"num_blocks_per_cache_level names no capacity for window sizes {missing}")
        return {w: _levels(num_blocks_per_cache_level[w]) for w in [*windows, *num_blocks_per_cache_level]}
    levels = _levels(num_blocks_per_cache_level)
    return {w: list(levels) for w in windows}


def _levels(values: Iterable[int]) -> list[int]:
    levels = list(values)
    for n in levels:
        if n.__class__ is not int or n < 0:
            raise ValueError(f"num_blocks_per_cache_level must hold ints >= 0, got {n!r}")
    return levels
