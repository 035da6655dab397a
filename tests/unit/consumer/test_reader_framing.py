"""Both framings into one index (``consumer._framing``) with the in-memory (mock://) registry:
single-object and current-schema Confluent messages take ``apply_encoded`` (the latter
re-framed), others are decoded by the codec; the index ends as a plain replay would."""

from __future__ import annotations

from typing import Any

import pytest
from confluent_kafka.schema_registry import SchemaRegistryClient
from kvevents.consumer import CacheIndex
from kvevents.consumer._framing import index_applier
from kvevents.schemas import (
    DecodeError,
    EventBatch,
    KVCacheCreatedData,
    KVCacheEvent,
    KVCacheStoredBlockData,
    KVCacheStoredData,
    current_fingerprint,
    encode_batch,
)
from kvevents.schemas.registry import RegistryCodec


def _batches() -> list[EventBatch]:
    out = [EventBatch("i0", [KVCacheEvent(0, KVCacheCreatedData([10]), 16)], sequence=0, producer_id=3)]
    for seq in range(1, 6):
        block = KVCacheStoredBlockData(seq, [seq] * 4)
        out.append(
            EventBatch(
                "i0",
                [KVCacheEvent(seq, KVCacheStoredData(seq - 1 or None, [block]), 16)],
                sequence=seq,
                producer_id=3,
            )
        )
    return out


class _Spy:
    def __init__(self, index: CacheIndex) -> None:
        self.index = index
        self.encoded: list[bytes] = []
        self.batches = 0

    def apply_encoded(self, data: Any) -> None:
        self.encoded.append(bytes(data))
        self.index.apply_encoded(data)

    def apply(self, batch: EventBatch) -> None:
        self.batches += 1
        self.index.apply(batch)


@pytest.fixture
def codec() -> RegistryCodec:
    return RegistryCodec(SchemaRegistryClient.new_client({"url": "mock://framing"}), "events")


def test_mixed_framings_reach_the_fast_path_and_equal_a_replay(codec: RegistryCodec) -> None:
    batches = _batches()
    messages = [encode_batch(b) if b.sequence < 3 else codec.encode_batch(b) for b in batches]
    spy = _Spy(CacheIndex())
    apply = index_applier(spy, codec)  # type: ignore[arg-type]
    for message in messages:
        apply(message)
    replay = CacheIndex()
    for batch in batches:
        replay.apply(batch)
    assert spy.index.same_state(replay) and spy.index.held_blocks() == 5
    assert len(spy.encoded) == len(messages) and spy.batches == 0
    header = b"\xc3\x01" + current_fingerprint()
    assert all(m.startswith(header) for m in spy.encoded)  # Confluent ones re-framed, same body
    assert spy.encoded[4][10:] == messages[4][5:]


def test_without_a_codec_confluent_messages_are_malformed(codec: RegistryCodec) -> None:
    apply = index_applier(CacheIndex(), None)
    with pytest.raises(DecodeError, match="Confluent wire format"):
        apply(codec.encode_batch(_batches()[0]))


def test_tombstones_and_junk_are_decode_errors(codec: RegistryCodec) -> None:
    apply = index_applier(CacheIndex(), codec)
    with pytest.raises(DecodeError, match="empty message"):
        apply(None)
    with pytest.raises(DecodeError):
        apply(b"\x00\x00\x00\x00\x63rest")  # schema id 99 is not registered
    with pytest.raises(DecodeError, match="wrong magic"):
        apply(b"\x07junk")
