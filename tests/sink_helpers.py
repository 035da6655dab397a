"""Helpers of the Kafka sink tests (unit and integration): a seeded engine workload whose
delivered events are known in advance, reassembly of split Stored events, and a consumer.

``Workload`` drives a manager through its engine API (``enqueue_*`` and ``flush``) and computes,
independently of the manager, the events it must deliver: ids in order, consecutive Removed
events of one window merged within an iteration, as TensorRT-LLM's manager does.
"""

from __future__ import annotations

import random
import time
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvevents.producer import BlockInfo
from kvevents.schemas import (
    EventBatch,
    KVCacheCreatedData,
    KVCacheEvent,
    KVCacheEventDiff,
    KVCacheRemovedData,
    KVCacheStoredBlockData,
    KVCacheStoredData,
    KVCacheUpdatedData,
    decode_batch,
)

U64_MAX = 2**64 - 1


def stored_block(info: BlockInfo) -> KVCacheStoredBlockData:
    """What the manager makes of a ``BlockInfo`` (the oracle's own mapping)."""
    return KVCacheStoredBlockData(
        info.block_hash,
        info.tokens,
        info.lora_id,
        0 if info.is_primary else 1,
        info.priority,
        info.token_extra_ids,
        info.mm_keys,
        info.cache_salt,
    )


def chain(
    first_hash: int, parent: int | None, count: int, tokens_per_block: int, rng: random.Random
) -> list[BlockInfo]:
    """``count`` chained blocks with varied optional fields."""
    blocks = []
    previous = parent
    for i in range(count):
        block_hash = (first_hash + i) % (U64_MAX + 1)
        tokens = [rng.randrange(-(2**31), 2**31) for _ in range(tokens_per_block)]
        fancy = rng.random() < 0.2
        blocks.append(
            BlockInfo(
                block_hash,
                previous,
                tokens,
                lora_id=rng.choice([None, 7, U64_MAX]) if fancy else None,
                is_primary=rng.random() < 0.9,
                priority=rng.randrange(0, 101) if fancy else 35,
                token_extra_ids=[rng.randrange(0, 2**64) for _ in tokens]
                if fancy and rng.random() < 0.3
                else None,
                mm_keys=((rng.randbytes(32), 0),) if fancy and rng.random() < 0.3 else (),
                cache_salt="salt✓" if fancy and rng.random() < 0.3 else None,
            )
        )
        previous = block_hash
    return blocks


@dataclass
class Workload:
    """A seeded mix of Stored / Removed / Updated / Created calls on one manager."""

    seed: int
    rank: int | None = None
    windows: Sequence[int] = (16, 32)
    expected: list[KVCacheEvent] = field(default_factory=list)
    _next_id: int = 0
    _next_hash: int = 1

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)

    def iteration(self, manager: Any, calls: int) -> None:
        """``calls`` engine calls, then ``flush()``; extends :attr:`expected`."""
        rng = self.rng
        open_removed: KVCacheEvent | None = None  # the iteration's last queued event, if Removed
        for _ in range(calls):
            window = rng.choice(self.windows)
            kind = rng.random()
            if kind < 0.45:
                blocks = chain(self._next_hash, rng.choice([None, rng.randrange(U64_MAX)]), rng.randint(1, 6),
                               rng.choice([16, 32]), rng)  # fmt: skip
                self._next_hash += len(blocks)
                manager.enqueue_stored_event(blocks, window)
                self._add(
                    KVCacheStoredData(blocks[0].prev_block_hash, [stored_block(b) for b in blocks]), window
                )
                open_removed = None
            elif kind < 0.85:
                block_hash = rng.randrange(U64_MAX + 1)
                manager.enqueue_removed_event(block_hash, window)
                if open_removed is not None and open_removed.window_size == window:
                    open_removed.data.block_hashes.append(block_hash)  # type: ignore[union-attr]
                else:
                    open_removed = self._add(KVCacheRemovedData([block_hash]), window)
            elif kind < 0.99:
                data = KVCacheUpdatedData(
                    rng.randrange(U64_MAX + 1),
                    cache_level=KVCacheEventDiff(0, 1) if rng.random() < 0.5 else None,
                    priority=KVCacheEventDiff(35, rng.randrange(101)) if rng.random() < 0.5 else None,
                )
                manager.enqueue_updated_event(data, window)
                self._add(data, window)
                open_removed = None
            else:
                levels = [rng.randrange(1, 10_000), rng.randrange(0, 10_000)]
                manager.enqueue_created_event(levels, window)
                self._add(KVCacheCreatedData(levels), window)
                open_removed = None
        manager.flush()

    def huge_stored(self, manager: Any, blocks: int, tokens_per_block: int = 32) -> None:
        """One Stored event of ``blocks`` blocks (larger than a small message limit), then ``flush()``."""
        infos = chain(self._next_hash, self.rng.randrange(U64_MAX), blocks, tokens_per_block, self.rng)
        self._next_hash += blocks
        manager.enqueue_stored_event(infos, 64)
        manager.flush()
        self._add(KVCacheStoredData(infos[0].prev_block_hash, [stored_block(b) for b in infos]), 64)

    def _add(self, data: Any, window: int) -> KVCacheEvent:
        event = KVCacheEvent(self._next_id, data, window, self.rank)
        self._next_id += 1
        self.expected.append(event)
        return event


def rank_events(rank: int, count: int, seed: int, first_id: int = 0) -> list[KVCacheEvent]:
    """Events as another attention-DP rank's gather would hand them to rank 0's buffer."""
    rng = random.Random(seed)
    events = []
    for i in range(count):
        if rng.random() < 0.5:
            blocks = [
                stored_block(b) for b in chain(rng.randrange(U64_MAX), None, rng.randint(1, 3), 16, rng)
            ]
            data: Any = KVCacheStoredData(None, blocks)
        else:
            data = KVCacheRemovedData([rng.randrange(U64_MAX + 1) for _ in range(rng.randint(1, 4))])
        events.append(KVCacheEvent(first_id + i, data, 32, rank))
    return events


def huge_stored_event(
    event_id: int, blocks: int, tokens_per_block: int, rank: int | None = None
) -> KVCacheEvent:
    rng = random.Random(event_id)
    infos = chain(rng.randrange(U64_MAX), rng.randrange(U64_MAX), blocks, tokens_per_block, rng)
    return KVCacheEvent(
        event_id, KVCacheStoredData(infos[0].prev_block_hash, [stored_block(b) for b in infos]), 64, rank
    )


def reassemble(batches: Iterable[EventBatch]) -> list[KVCacheEvent]:
    """The events of one producer's batches (in sequence order) with split Stored events joined,
    checking the continuation rules: same event id, block offset, parent = previous last hash."""
    events: list[KVCacheEvent] = []
    for batch in batches:
        batch_events = batch.events
        offset = batch.first_event_block_offset
        if offset:
            head, previous = batch_events[0], events[-1]
            assert head.event_id == previous.event_id, (head.event_id, previous.event_id)
            assert (head.window_size, head.attention_dp_rank) == (
                previous.window_size,
                previous.attention_dp_rank,
            )
            assert isinstance(head.data, KVCacheStoredData) and isinstance(previous.data, KVCacheStoredData)
            assert len(previous.data.blocks) == offset, (len(previous.data.blocks), offset)
            assert head.data.parent_hash == previous.data.blocks[-1].block_hash
            joined = KVCacheStoredData(previous.data.parent_hash, previous.data.blocks + head.data.blocks)
            events[-1] = KVCacheEvent(
                previous.event_id, joined, previous.window_size, previous.attention_dp_rank
            )
            batch_events = batch_events[1:]
        events.extend(batch_events)
    return events


def by_rank(events: Iterable[KVCacheEvent]) -> dict[int, list[KVCacheEvent]]:
    out: dict[int, list[KVCacheEvent]] = {}
    for event in events:
        out.setdefault(event.attention_dp_rank or 0, []).append(event)
    return out


@dataclass(frozen=True)
class Consumed:
    """One message read back from Kafka."""

    key: bytes | None
    headers: dict[str, bytes]
    size: int
    partition: int
    offset: int
    batch: EventBatch


def consume(
    bootstrap: str,
    topic: str,
    *,
    expect_messages: int | None = None,
    idle_s: float = 3.0,
    timeout_s: float = 120.0,
) -> list[Consumed]:
    """Read every partition of ``topic`` from the beginning (assigned, no consumer group): until
    ``expect_messages`` are read (then ``idle_s`` more to catch extras), or until nothing came
    for ``idle_s``."""
    from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaError, TopicPartition

    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": f"sink-test-{uuid.uuid4().hex}",
            "auto.offset.reset": "earliest",
            "enable.auto.commit": False,
            "enable.partition.eof": False,
        }
    )
    partitions = consumer.list_topics(topic, timeout=30).topics[topic].partitions
    consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in partitions])
    out: list[Consumed] = []
    deadline = time.monotonic() + timeout_s
    last = time.monotonic()
    try:
        while time.monotonic() < deadline:
            messages = consumer.consume(1000, 0.5)
            for message in messages:
                error = message.error()
                if error is not None:
                    assert error.code() == KafkaError._PARTITION_EOF, error
                    continue
                out.append(
                    Consumed(
                        message.key(),
                        {k: v for k, v in (message.headers() or [])},
                        len(message.value()),
                        message.partition(),
                        message.offset(),
                        decode_batch(message.value()),
                    )
                )
            if messages:
                last = time.monotonic()
            elif time.monotonic() - last > idle_s and (
                expect_messages is None or len(out) >= expect_messages
            ):
                break
    finally:
        consumer.close()
    return out


def batches_of(consumed: Iterable[Consumed], instance_id: str) -> list[EventBatch]:
    """One instance's batches in sequence order (one producer per instance in these tests)."""
    batches = [c.batch for c in consumed if c.batch.instance_id == instance_id]
    return sorted(batches, key=lambda b: b.sequence)


def dropped_by_rank(batches: Iterable[EventBatch]) -> dict[int, int]:
    total: dict[int, int] = {}
    for batch in batches:
        for drop in batch.dropped:
            total[drop.attention_dp_rank] = total.get(drop.attention_dp_rank, 0) + drop.dropped_events
    return total


def wait_for(predicate: Any, timeout: float, interval: float = 0.02) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return bool(predicate())
