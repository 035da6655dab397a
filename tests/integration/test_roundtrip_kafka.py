"""EventBatches through a real Kafka broker: produce, consume, decode, equal to what was sent.

Every event type, every optional field set and unset, block hashes at both ends of the unsigned
64-bit range, empty and large blocks, unicode cache salts and multimodal keys.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable

import pytest
from confluent_kafka import Consumer, KafkaError, Producer
from kvevents.schemas import (
    CONTENT_TYPE,
    EventBatch,
    KVCacheCreatedData,
    KVCacheEvent,
    KVCacheEventDiff,
    KVCacheRemovedData,
    KVCacheStoredBlockData,
    KVCacheStoredData,
    KVCacheUpdatedData,
    RankDrops,
    decode_batch,
    encode_batch,
)

pytestmark = pytest.mark.kafka

U64_MAX = 2**64 - 1
I32_MIN, I32_MAX = -(2**31), 2**31 - 1
MAX_MESSAGE_BYTES = 8 << 20


def every_field_set_block(block_hash: int, tokens: list[int]) -> KVCacheStoredBlockData:
    return KVCacheStoredBlockData(
        block_hash=block_hash,
        tokens=tokens,
        lora_id=U64_MAX,
        cache_level=1,
        priority=0,
        token_extra_ids=[0] * (len(tokens) - 1) + [U64_MAX] if tokens else None,
        mm_keys=((bytes(32), 0), (bytes([0xFF]) * 32, max(len(tokens) - 1, 0)), (bytes(range(32)), 7)),
        cache_salt="租户-✓-🔑 salt",
    )


def pseudo_random_tokens(seed: int, count: int) -> list[int]:
    """Token ids spread over the int32 range (an LCG: reproducible, no shared random state)."""
    tokens, state = [], seed + 1
    for _ in range(count):
        state = (state * 6364136223846793005 + 1442695040888963407) % 2**64
        tokens.append((state >> 32) - 2**31)
    return tokens


def sample_batches() -> list[EventBatch]:
    large_tokens = [I32_MIN, I32_MAX, *range(4094)]
    assert len(large_tokens) == 4096
    stored_everything = KVCacheStoredData(
        parent_hash=U64_MAX,
        blocks=[
            KVCacheStoredBlockData(block_hash=0, tokens=[]),  # empty block, all defaults
            every_field_set_block(U64_MAX, large_tokens),  # large block, every field set
            KVCacheStoredBlockData(block_hash=2**63, tokens=[1, 2, 3], lora_id=0, cache_salt=""),
            KVCacheStoredBlockData(block_hash=2**63 - 1, tokens=[5] * 32, token_extra_ids=[7] * 32),
        ],
    )
    stored_defaults = KVCacheStoredData(
        parent_hash=None, blocks=[KVCacheStoredBlockData(block_hash=1, tokens=list(range(32)))]
    )
    events = [
        KVCacheEvent(0, KVCacheCreatedData([1024, 4096]), window_size=4096),
        KVCacheEvent(1, KVCacheCreatedData([]), window_size=0, attention_dp_rank=0),
        KVCacheEvent(2, stored_defaults, window_size=32),
        KVCacheEvent(3, stored_everything, window_size=I32_MAX, attention_dp_rank=3),
        KVCacheEvent(4, KVCacheRemovedData([0, 1, 2**63 - 1, 2**63, U64_MAX]), window_size=32),
        KVCacheEvent(5, KVCacheRemovedData([]), window_size=32, attention_dp_rank=1),
        KVCacheEvent(
            6,
            KVCacheUpdatedData(
                U64_MAX, cache_level=KVCacheEventDiff(0, 1), priority=KVCacheEventDiff(35, 100)
            ),
            window_size=32,
        ),
        KVCacheEvent(7, KVCacheUpdatedData(0, cache_level=KVCacheEventDiff(1, 0)), window_size=32),
        KVCacheEvent(
            8, KVCacheUpdatedData(2**40, priority=KVCacheEventDiff(I32_MIN, I32_MAX)), window_size=32
        ),
        KVCacheEvent(9, KVCacheUpdatedData(42), window_size=32),
    ]
    many_large_blocks = KVCacheStoredData(
        parent_hash=0,
        blocks=[every_field_set_block(i * 7919 + 1, pseudo_random_tokens(i, 4096)) for i in range(96)],
    )
    now_us = time.time_ns() // 1000
    return [
        EventBatch("engine-a", events),  # every envelope field at its default
        EventBatch(
            "engine-b/rank✓",
            events[::-1],
            attention_dp_size=4,
            producer_id=2**62 + 5,
            sequence=1,
            created_at_us=now_us,
            dropped=[RankDrops(0, 0), RankDrops(3, 2**40)],
            first_event_block_offset=2,
        ),
        EventBatch("engine-a", [], sequence=1, created_at_us=now_us),  # no events at all
        EventBatch("engine-a", [KVCacheEvent(10, many_large_blocks, window_size=4096)], sequence=2),
    ]


def consume_all(bootstrap: str, topic: str, count: int, timeout: float = 60.0) -> list:
    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": f"roundtrip-{uuid.uuid4().hex}",
            "auto.offset.reset": "earliest",
            "enable.auto.commit": False,
            "fetch.message.max.bytes": MAX_MESSAGE_BYTES,
        }
    )
    consumer.subscribe([topic])
    messages = []
    deadline = time.monotonic() + timeout
    try:
        while len(messages) < count and time.monotonic() < deadline:
            message = consumer.poll(0.5)
            if message is None:
                continue
            if message.error() is not None:
                assert message.error().code() == KafkaError._PARTITION_EOF, message.error()
                continue
            messages.append(message)
    finally:
        consumer.close()
    assert len(messages) == count, f"consumed {len(messages)} of {count} messages in {timeout:.0f} s"
    return messages


def test_batches_survive_a_real_broker(kafka_bootstrap: str, kafka_topic_factory: Callable[..., str]) -> None:
    topic = kafka_topic_factory(partitions=3, max_message_bytes=MAX_MESSAGE_BYTES)
    batches = sample_batches()
    encoded = [encode_batch(batch) for batch in batches]
    assert len(encoded[-1]) > 1 << 20, "the large batch must exceed Kafka's default 1 MiB message size"

    producer = Producer(
        {
            "bootstrap.servers": kafka_bootstrap,
            "enable.idempotence": True,
            "message.max.bytes": MAX_MESSAGE_BYTES + 1024,
        }
    )
    delivery_errors: list[KafkaError] = []
    for batch, data in zip(batches, encoded, strict=True):
        producer.produce(
            topic,
            key=batch.instance_id.encode(),
            value=data,
            headers={"content-type": CONTENT_TYPE},
            on_delivery=lambda err, _msg: delivery_errors.append(err) if err else None,
        )
    assert producer.flush(30) == 0
    assert delivery_errors == []

    messages = consume_all(kafka_bootstrap, topic, len(batches))
    received: dict[str, list[EventBatch]] = {}
    for message in messages:
        assert dict(message.headers())["content-type"] == CONTENT_TYPE.encode()
        batch = decode_batch(message.value())
        assert message.key() == batch.instance_id.encode()
        assert message.value() in encoded, "the bytes in Kafka are the bytes produced"
        received.setdefault(batch.instance_id, []).append(batch)

    sent: dict[str, list[EventBatch]] = {}
    for batch in batches:
        sent.setdefault(batch.instance_id, []).append(batch)
    assert received == sent  # equal per instance, and in the order produced


def test_sample_covers_what_the_round_trip_promises() -> None:
    """Guard the sample itself: every event type and each optional field both set and unset."""
    events = [e for batch in sample_batches() for e in batch.events]
    kinds = {type(e.data) for e in events}
    assert kinds == {KVCacheCreatedData, KVCacheStoredData, KVCacheRemovedData, KVCacheUpdatedData}
    blocks = [b for e in events if isinstance(e.data, KVCacheStoredData) for b in e.data.blocks]
    for field, unset in (("lora_id", None), ("token_extra_ids", None), ("cache_salt", None), ("mm_keys", ())):
        values = [getattr(b, field) for b in blocks]
        assert unset in values and any(v != unset for v in values), field
    assert {0, U64_MAX} <= {b.block_hash for b in blocks}
    assert {len(b.tokens) for b in blocks} >= {0, 4096}
    assert {e.attention_dp_rank is None for e in events} == {True, False}
    updates = [e.data for e in events if isinstance(e.data, KVCacheUpdatedData)]
    assert {(u.cache_level is None, u.priority is None) for u in updates} == {
        (False, False),
        (False, True),
        (True, False),
        (True, True),
    }
    parents = {e.data.parent_hash for e in events if isinstance(e.data, KVCacheStoredData)}
    assert None in parents and U64_MAX in parents
