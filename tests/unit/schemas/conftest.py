"""Fixtures of the codec tests: both body codecs, and batches that use every field."""

from __future__ import annotations

from array import array

import pytest
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
    codec,
)

EDGE_HASHES = (0, 1, 2**63 - 1, 2**63, 2**64 - 1)
INT32_EDGES = (-(2**31), -1, 0, 2**31 - 1)
INT64_EDGES = (-(2**63), -1, 0, 2**63 - 1)


def block_unset(block_hash: int = 0x1234, n_tokens: int = 4) -> KVCacheStoredBlockData:
    """A block with every optional field at its default."""
    return KVCacheStoredBlockData(block_hash, array("i", range(100, 100 + n_tokens)))


def block_set(block_hash: int = 2**64 - 1) -> KVCacheStoredBlockData:
    """A block with every optional field set, at awkward values."""
    return KVCacheStoredBlockData(
        block_hash,
        array("i", [0, 1, -1, 2**31 - 1, -(2**31), 128_255]),
        lora_id=2**63,
        cache_level=1,
        priority=100,
        token_extra_ids=array("Q", [0, 2**64 - 1, 2**63, 1, 0, 42]),
        mm_keys=((bytes(range(32)), 0), (b"\xff" * 32, -7)),
        cache_salt="tenant-äöü-雪-🙂",
    )


def every_event() -> list[KVCacheEvent]:
    """Each event type with its optional fields set and unset, edge hashes, empty and big blocks."""
    return [
        KVCacheEvent(0, KVCacheCreatedData([1000, 4000]), 4096),
        KVCacheEvent(1, KVCacheCreatedData([], snapshot=True), 4096, attention_dp_rank=3),
        KVCacheEvent(2, KVCacheStoredData(None, [block_unset()]), 4096),
        KVCacheEvent(3, KVCacheStoredData(2**64 - 1, [block_set(), block_unset(0, 0)]), 4096, 0),
        KVCacheEvent(4, KVCacheStoredData(0, []), 128),
        KVCacheEvent(
            5,
            KVCacheStoredData(2**63, [KVCacheStoredBlockData(2**63 - 1, array("i", range(4096)))]),
            32768,
        ),
        KVCacheEvent(6, KVCacheRemovedData(list(EDGE_HASHES)), 4096),
        KVCacheEvent(7, KVCacheRemovedData([]), 4096, attention_dp_rank=2**31 - 1),
        KVCacheEvent(8, KVCacheUpdatedData(2**64 - 1), 4096),
        KVCacheEvent(9, KVCacheUpdatedData(0, cache_level=KVCacheEventDiff(0, 1)), 4096),
        KVCacheEvent(10, KVCacheUpdatedData(2**63, priority=KVCacheEventDiff(35, 90)), 4096),
        KVCacheEvent(
            2**63 - 1,
            KVCacheUpdatedData(7, KVCacheEventDiff(1, 0), KVCacheEventDiff(-(2**31), 2**31 - 1)),
            -(2**31),
            attention_dp_rank=-1,
        ),
    ]


def full_batch() -> EventBatch:
    """A batch that sets every envelope field and carries :func:`every_event`."""
    return EventBatch(
        "engine-Ω-0",
        every_event(),
        attention_dp_size=4,
        producer_id=-(2**63),
        sequence=2**63 - 1,
        created_at_us=1_767_225_600_123_456,
        dropped=[RankDrops(0, 0), RankDrops(3, 2**40)],
        first_event_block_offset=2,
    )


def _describe(event: KVCacheEvent) -> str:
    data = event.data
    name = type(data).__name__.removeprefix("KVCache").removesuffix("Data").lower()
    return f"{event.event_id}-{name}"


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """``sample_event``: one test per event of :func:`every_event`."""
    if "sample_event" in metafunc.fixturenames:
        events = every_event()
        metafunc.parametrize("sample_event", events, ids=[_describe(e) for e in events])


@pytest.fixture(name="full_batch")
def full_batch_fixture() -> EventBatch:
    """:func:`full_batch`."""
    return full_batch()


@pytest.fixture(params=["compiled", "fastavro"])
def body_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> codec.BodyCodec:
    """Run the test once with the compiled body codec and once with the fastavro reference.

    The compiled codec is part of the install (``make setup`` builds it): missing, it fails.
    """
    if request.param == "compiled":
        if codec._COMPILED is None:
            pytest.fail(
                "kvevents.schemas._fastcodec is not built or does not match the schema; run make setup"
            )
        body = codec._COMPILED
    else:
        body = codec._REFERENCE
    monkeypatch.setattr(codec, "_BODY", body)
    return body


@pytest.fixture
def fresh_writers(monkeypatch: pytest.MonkeyPatch) -> dict[bytes, object]:
    """A private copy of the known writer schemas, so registrations do not leak between tests."""
    writers = dict(codec._WRITERS)
    monkeypatch.setattr(codec, "_WRITERS", writers)
    return writers
