"""Test streams for the reader and checkpoint tests: batches of several instances, produced
to a real topic the way the sink does (keyed by instance id, idempotent, its compression)."""

from __future__ import annotations

import random
import zlib
from collections.abc import Iterable

from confluent_kafka import Producer
from kvevents.producer.sink_config import DEFAULT_PRODUCER_CONFIG
from kvevents.schemas import (
    EventBatch,
    KVCacheCreatedData,
    KVCacheEvent,
    KVCacheEventDiff,
    KVCacheRemovedData,
    KVCacheStoredBlockData,
    KVCacheStoredData,
    KVCacheUpdatedData,
    RankDrops,
    encode_batch,
)

WINDOW = 64
BLOCK = 4


class StreamMaker:
    """Instances with attention-DP ranks emitting Created/Stored/Removed/Updated events, now
    and then with drops, in numbered batches. Engine hashes differ per instance, so that the
    index state does not depend on how partitions interleave."""

    def __init__(self, seed: int, instances: int = 3, dp: int = 2) -> None:
        self.rng = random.Random(seed)
        self.dp = dp
        self.names = [f"inst-{i}" for i in range(instances)]
        self.sequence = dict.fromkeys(self.names, 0)
        self.next_id = {(n, r): 0 for n in self.names for r in range(dp)}
        self.held: dict[tuple[str, int], list[int]] = {(n, r): [] for n in self.names for r in range(dp)}
        self.counter = 0

    def _event(self, name: str, rank: int) -> KVCacheEvent:
        rng, key = self.rng, (name, rank)
        held = self.held[key]
        eid = self.next_id[key]
        self.next_id[key] += 1
        roll = rng.random()
        if eid == 0:
            data: object = KVCacheCreatedData([100, 10])
        elif roll < 0.55 or not held:
            parent = rng.choice([None, *held[-3:]]) if held else None
            blocks = []
            for _ in range(rng.randint(1, 4)):
                self.counter += 1
                h = (zlib.crc32(name.encode()) & 0xFFFF) << 40 | self.counter
                blocks.append(
                    KVCacheStoredBlockData(
                        h,
                        [rng.randrange(50) for _ in range(BLOCK)],
                        cache_level=rng.choice([0, 0, 1]),
                        priority=rng.randrange(101),
                    )
                )
                held.append(h)
            data = KVCacheStoredData(parent, blocks)
        elif roll < 0.8:
            victims = rng.sample(held, min(len(held), rng.randint(1, 3)))
            for v in victims:
                held.remove(v)
            data = KVCacheRemovedData(victims)
        else:
            data = KVCacheUpdatedData(
                rng.choice(held), KVCacheEventDiff(0, 1), KVCacheEventDiff(35, rng.randrange(101))
            )
        return KVCacheEvent(eid, data, WINDOW, rank)  # type: ignore[arg-type]

    def batch(self, name: str | None = None, events: int | None = None) -> EventBatch:
        name = name or self.rng.choice(self.names)
        evs = [
            self._event(name, self.rng.randrange(self.dp)) for _ in range(events or self.rng.randint(1, 12))
        ]
        evs.sort(key=lambda e: (e.attention_dp_rank, e.event_id))
        dropped = [RankDrops(0, 2)] if self.rng.random() < 0.03 else []
        seq = self.sequence[name]
        self.sequence[name] += 1
        return EventBatch(name, evs, attention_dp_size=self.dp, producer_id=11, sequence=seq, dropped=dropped)

    def batches(self, count: int) -> list[EventBatch]:
        return [self.batch() for _ in range(count)]


def producer(bootstrap: str) -> Producer:
    return Producer(
        {
            "bootstrap.servers": bootstrap,
            "enable.idempotence": True,
            "compression.type": DEFAULT_PRODUCER_CONFIG["compression.type"],
            "linger.ms": 5,
            "partitioner": "murmur2_random",
        }
    )


def produce(
    bootstrap: str, topic: str, items: Iterable[EventBatch | tuple[bytes | None, bytes | None]]
) -> int:
    """Produce batches (keyed by instance id) or raw (key, value) pairs; wait for delivery."""
    failures: list[object] = []
    p = producer(bootstrap)
    count = 0
    for item in items:
        if isinstance(item, EventBatch):
            key, value = item.instance_id.encode(), encode_batch(item)
        else:
            key, value = item
        p.produce(topic, value=value, key=key, on_delivery=lambda err, _m: err and failures.append(err))
        p.poll(0)
        count += 1
    assert p.flush(30) == 0 and not failures, failures
    return count
