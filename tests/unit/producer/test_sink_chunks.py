"""Cutting events into Kafka-sized chunks, and writing a chunk as a message at hand-off time."""

from __future__ import annotations

import random

import pytest
from kvevents.producer.sink_chunks import (
    Chunk,
    Chunker,
    EnvelopeWriter,
    LostEvent,
    SingleObjectCodec,
)
from kvevents.schemas import (
    EventBatch,
    KVCacheEvent,
    KVCacheRemovedData,
    KVCacheStoredBlockData,
    KVCacheStoredData,
    RankDrops,
    decode_batch,
    encode_batch,
)
from sink_helpers import huge_stored_event, rank_events, reassemble

INSTANCE = "engine-7"


def writer(dp_size: int = 4, codec: object | None = None) -> EnvelopeWriter:
    return EnvelopeWriter(codec or SingleObjectCodec(), INSTANCE, dp_size)  # type: ignore[arg-type]


def envelope(sequence: int = 0, offset: int = 0, dropped: list[RankDrops] | None = None) -> dict[str, object]:
    return {
        "producer_id": 2**62 + 11,
        "sequence": sequence,
        "created_at_us": 1_765_000_000_123_456,
        "dropped": dropped or [],
        "first_event_block_offset": offset,
    }


def message_of(w: EnvelopeWriter, chunk: Chunk, sequence: int = 0) -> bytes:
    return w.message(chunk.part, **envelope(sequence, chunk.first_event_block_offset))  # type: ignore[arg-type]


def mixed(count: int = 300, seed: int = 1) -> list[KVCacheEvent]:
    """Three ranks' events interleaved at random, each rank's in order (as rank 0's buffer holds them)."""
    queues = [rank_events(rank, count // 3, seed + rank, first_id=1000 * rank) for rank in range(3)]
    rng = random.Random(seed)
    events = []
    while any(queues):
        queue = rng.choice([q for q in queues if q])
        events.append(queue.pop(0))
    return events


@pytest.mark.parametrize("splice", [True, False])
def test_a_message_is_the_envelope_spliced_before_the_encoded_events(splice: bool) -> None:
    w = writer()
    events = mixed(60)
    part = w.events_part(events)
    drops = [RankDrops(0, 3), RankDrops(2, 2**40)]
    if not splice:
        w._splice = False  # the fallback for a schema whose events are not the last field
    message = w.message(part, **envelope(41, 0, drops))  # type: ignore[arg-type]
    assert w.splices is splice
    expected = EventBatch(INSTANCE, events, attention_dp_size=4, **envelope(41, 0, drops))  # type: ignore[arg-type]
    assert message == encode_batch(expected)
    assert decode_batch(message) == expected


def test_splicing_also_holds_for_the_confluent_framing() -> None:
    from kvevents.schemas.registry import RegistryCodec

    codec = RegistryCodec("mock://sink-chunks", topic="kv")
    w = writer(codec=codec)
    events = mixed(30)
    message = w.message(w.events_part(events), **envelope(5))  # type: ignore[arg-type]
    assert w.splices is True
    assert message[0] == 0  # Confluent magic byte, then the schema id
    assert codec.decode_batch(message) == EventBatch(INSTANCE, events, attention_dp_size=4, **envelope(5))  # type: ignore[arg-type]


def test_max_prefix_size_bounds_every_envelope() -> None:
    w = writer(dp_size=8)
    part = w.events_part(mixed(3))
    worst = w.message(
        part,
        producer_id=2**63 - 1,
        sequence=2**63 - 1,
        created_at_us=2**63 - 1,
        dropped=[RankDrops(r, 2**63 - 1) for r in range(8)],
        first_event_block_offset=2**31 - 1,
    )
    assert len(worst) - len(part) <= w.max_prefix_size()
    assert len(w.message(part, **envelope())) - len(part) < w.max_prefix_size()  # type: ignore[arg-type]


def test_small_drains_make_one_chunk_with_per_rank_counts() -> None:
    events = mixed(30)
    chunks = list(Chunker(writer()).chunks(events, 1 << 20))
    assert len(chunks) == 1 and isinstance(chunks[0], Chunk)
    chunk = chunks[0]
    assert chunk.events == 30
    assert chunk.by_rank == {r: sum(1 for e in events if e.attention_dp_rank == r) for r in range(3)}
    assert chunk.last_event_ids == {
        r: max(e.event_id for e in events if e.attention_dp_rank == r) for r in range(3)
    }


@pytest.mark.parametrize("budget", [600, 2_000, 20_000])
def test_chunks_fit_the_budget_and_keep_every_event_in_order(budget: int) -> None:
    w = writer()
    events = mixed(600, seed=budget)
    events.insert(100, huge_stored_event(5000, blocks=60, tokens_per_block=16, rank=1))  # split when small
    chunker = Chunker(w)
    items = list(chunker.chunks(events, budget))
    assert not [i for i in items if isinstance(i, LostEvent)]
    chunks = [i for i in items if isinstance(i, Chunk)]
    assert all(c.size <= budget for c in chunks)
    batches = [decode_batch(message_of(w, c, n)) for n, c in enumerate(chunks)]
    assert reassemble(batches) == events
    splits = {id(c.split) for c in chunks if c.split is not None}
    assert sum(c.events for c in chunks if c.split is None) + len(splits) == len(events)
    assert (len(splits) > 0) == (budget < 20_000)


def test_large_drains_are_sliced_by_estimate_and_chunks_are_well_filled() -> None:
    w = writer()
    events = mixed(3000, seed=9)
    chunker = Chunker(w)
    list(chunker.chunks(events[:100], 8000))  # learns bytes per event
    chunks = [c for c in chunker.chunks(events, 8000) if isinstance(c, Chunk)]
    assert all(c.size <= 8000 for c in chunks)
    assert sum(c.size for c in chunks) / len(chunks) > 0.6 * 8000
    assert [e for c in chunks for e in decode_batch(message_of(w, c)).events] == events


def test_a_huge_stored_event_is_cut_at_block_boundaries() -> None:
    w = writer()
    event = huge_stored_event(77, blocks=50, tokens_per_block=32, rank=2)
    items = list(Chunker(w).chunks([event], 1500))
    chunks = [i for i in items if isinstance(i, Chunk)]
    assert len(chunks) == len(items) >= 2
    split = chunks[0].split
    assert split is not None and split.fragments == len(chunks) and split.rank == 2 and split.event_id == 77
    assert all(c.split is split and c.events == 1 and c.by_rank == {} for c in chunks)
    assert chunks[0].first_event_block_offset == 0
    offsets = [c.first_event_block_offset for c in chunks]
    assert offsets == sorted(set(offsets))
    batches = [decode_batch(message_of(w, c, n)) for n, c in enumerate(chunks)]
    for batch, offset in zip(batches, offsets, strict=True):
        assert batch.first_event_block_offset == offset
        assert len(batch.events) == 1 and batch.events[0].event_id == 77
    assert reassemble(batches) == [event]
    assert batches[1].events[0].data.parent_hash == batches[0].events[0].data.blocks[-1].block_hash  # type: ignore[union-attr]


def test_an_event_that_cannot_fit_is_lost_not_skipped() -> None:
    w = writer()
    removed = KVCacheEvent(3, KVCacheRemovedData(list(range(5000))), 32, 1)
    one_big_block = KVCacheEvent(
        4,
        KVCacheStoredData(
            None, [KVCacheStoredBlockData(1, range(10)), KVCacheStoredBlockData(2, range(2000))]
        ),
        32,
        2,
    )
    small = KVCacheEvent(5, KVCacheRemovedData([9]), 32, 0)
    items = list(Chunker(w).chunks([small, removed, one_big_block, small], 1000))
    lost = [i for i in items if isinstance(i, LostEvent)]
    assert [(x.rank, x.event_id, x.reason) for x in lost] == [(1, 3, "oversized"), (2, 4, "oversized")]
    assert "KVCacheRemovedData" in lost[0].detail and "block 1" in lost[1].detail
    # no fragment of the event with the oversized block is emitted
    chunks = [i for i in items if isinstance(i, Chunk)]
    assert [e for c in chunks for e in decode_batch(message_of(w, c)).events] == [small, small]
    assert [type(i).__name__ for i in items] == ["Chunk", "LostEvent", "LostEvent", "Chunk"]


def test_an_event_the_codec_rejects_is_lost_and_its_neighbours_kept() -> None:
    w = writer()
    good = rank_events(0, 40, seed=3)
    bad = KVCacheEvent(999, KVCacheRemovedData([2**64]), 32, 3)  # outside the unsigned 64-bit range
    events = [*good[:25], bad, *good[25:]]
    items = list(Chunker(w).chunks(events, 1 << 20))
    lost = [i for i in items if isinstance(i, LostEvent)]
    assert [(x.rank, x.event_id, x.reason) for x in lost] == [(3, 999, "unencodable")]
    assert "64" in lost[0].detail
    chunks = [i for i in items if isinstance(i, Chunk)]
    assert [e for c in chunks for e in decode_batch(message_of(w, c)).events] == good


def test_single_rank_fast_path_counts_like_the_general_one() -> None:
    events = rank_events(0, 50, seed=5)
    fast = next(iter(Chunker(writer(), single_rank=True).chunks(events, 1 << 20)))
    general = next(iter(Chunker(writer(), single_rank=False).chunks(events, 1 << 20)))
    assert isinstance(fast, Chunk) and isinstance(general, Chunk)
    assert (
        (fast.by_rank, fast.last_event_ids) == (general.by_rank, general.last_event_ids) == ({0: 50}, {0: 49})
    )


def test_a_budget_too_small_for_anything_is_refused() -> None:
    with pytest.raises(ValueError, match="budget"):
        list(Chunker(writer()).chunks(mixed(3), 8))


def test_max_events_caps_every_chunk_and_keeps_order() -> None:
    w = writer()
    events = mixed(900, seed=4)
    chunks = [c for c in Chunker(w, max_events=100).chunks(events, 1 << 20) if isinstance(c, Chunk)]
    assert [c.events for c in chunks] == [100] * 9
    assert [e for c in chunks for e in decode_batch(message_of(w, c)).events] == events
