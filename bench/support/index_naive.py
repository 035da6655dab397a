"""The index a user would write in pure Python: block hash -> set of workers, fed batches
already decoded (``decode_batch``). It is the bench's second baseline (issue 17).

Workers are ``(instance_id, attention_dp_rank)`` (rank None counts as 0). It ignores levels,
windows, parents, event ids and sessions: Stored adds, Removed discards, Created clears the
worker, Updated changes nothing (a secondary block still counts, as in ``find_matches``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from kvevents.schemas import EventBatch, KVCacheCreatedData, KVCacheRemovedData, KVCacheStoredData

Worker = tuple[str, int]


class NaiveIndex:
    """Which workers hold each block hash; matching walks the query intersecting their sets."""

    def __init__(self) -> None:
        self.holders: dict[int, set[Worker]] = {}
        self.held: dict[Worker, set[int]] = {}

    def apply(self, batch: EventBatch) -> None:
        holders, instance = self.holders, batch.instance_id
        for event in batch.events:
            worker = (instance, event.attention_dp_rank or 0)
            data = event.data
            if isinstance(data, KVCacheStoredData):
                mine = self.held.setdefault(worker, set())
                for block in data.blocks:
                    h = block.block_hash
                    holders.setdefault(h, set()).add(worker)
                    mine.add(h)
            elif isinstance(data, KVCacheRemovedData):
                mine = self.held.get(worker, set())
                for h in data.block_hashes:
                    self._drop(h, worker)
                    mine.discard(h)
            elif isinstance(data, KVCacheCreatedData):
                for h in self.held.pop(worker, ()):
                    self._drop(h, worker)

    def apply_all(self, batches: Iterable[EventBatch]) -> None:
        for batch in batches:
            self.apply(batch)

    def _drop(self, h: int, worker: Worker) -> None:
        workers = self.holders.get(h)
        if workers is not None:
            workers.discard(worker)
            if not workers:
                del self.holders[h]

    def find_matches(self, block_hashes: Sequence[int]) -> dict[Worker, int]:
        """Per worker, how many leading blocks of the query it holds (workers with 0 omitted)."""
        result: dict[Worker, int] = {}
        holders = self.holders
        alive: set[Worker] = set()
        depth = 0
        for h in block_hashes:
            found = holders.get(h)
            if not found:
                break
            if depth == 0:
                alive = set(found)
            else:
                for worker in alive - found:
                    result[worker] = depth
                alive &= found
                if not alive:
                    break
            depth += 1
        for worker in alive:
            result[worker] = depth
        return result

    def held_blocks(self) -> int:
        """Worker-block pairs held."""
        return sum(len(s) for s in self.held.values())
