"""The event streams the soak targets damage: valid batches of the index's own schema."""

from __future__ import annotations

import random
from array import array
from typing import Any

from kvevents.schemas import (
    EventBatch,
    KVCacheCreatedData,
    KVCacheEvent,
    KVCacheEventDiff,
    KVCacheRemovedData,
    KVCacheStoredBlockData,
    KVCacheStoredData,
    KVCacheUpdatedData,
)


def index_batches(seed: int) -> list[EventBatch]:
    """Two instances of two ranks: Created, Stored chains, Removed and Updated events (blocks of 4 tokens)."""
    rng = random.Random(seed)
    batches = []
    held: dict[tuple[str, int], list[int]] = {}
    ids: dict[tuple[str, int], int] = {}
    for seq in range(40):
        for instance in ("i0", "i1"):
            events = []
            for rank in (0, 1):
                key = (instance, rank)
                eid = ids.get(key, 0)
                if key not in held:
                    events.append(KVCacheEvent(eid, KVCacheCreatedData([1000, 100]), 64, rank))
                    held[key], eid = [], eid + 1
                roll = rng.random()
                if roll < 0.6 or not held[key]:
                    hashes = [rng.getrandbits(62) for _ in range(rng.randint(1, 8))]
                    blocks = [
                        KVCacheStoredBlockData(h, array("i", [rng.randrange(1 << 17) for _ in range(4)]))
                        for h in hashes
                    ]
                    parent = held[key][-1] if held[key] and rng.random() < 0.7 else None
                    data: Any = KVCacheStoredData(parent, blocks)
                    held[key] += hashes
                elif roll < 0.85:
                    data = KVCacheRemovedData(held[key][-2:])
                    del held[key][-2:]
                else:
                    data = KVCacheUpdatedData(held[key][0], KVCacheEventDiff(0, 1), KVCacheEventDiff(35, 50))
                events.append(KVCacheEvent(eid, data, 64, rank))
                ids[key] = eid + 1
            batches.append(EventBatch(instance, events, attention_dp_size=2, producer_id=7, sequence=seq))
    return batches
