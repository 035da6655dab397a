"""Rank 0's pass-through of the other ranks' Avro bytes (no MPI): ``read_encoded`` reads what
``read_batch`` reads and rejects what ``check_batch`` rejects; the buffer holds such events
under the same truncation and drop counts as objects; ``drain_encoded`` hands the sink the same
events, in the same order, as ``drain``; and the sink's messages carry them."""

from __future__ import annotations

import sys
from array import array
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kvevents.producer import EventBuffer
from kvevents.producer._gather_wire import (
    ProtocolError,
    check_batch,
    check_encoded,
    chunk_batches,
    read_batch,
    read_encoded,
)
from kvevents.producer.sink_encoded import EncodedEvents, encode_event, encode_events, scan_body
from kvevents.schemas import (
    DecodeError,
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "schemas"))
from test_codec_properties import batches


@pytest.fixture(autouse=True)
def _compiled_reader() -> None:
    """The compiled gather reader is part of the install (``make setup`` builds it): missing, the
    tests fail rather than skip, as the compiled codec's do (tests/unit/schemas/conftest.py)."""
    if scan_body is None:
        pytest.fail("kvevents.producer._gatherscan is not built; run make setup")


def mixed(rank: int | None, ids: range, window: int = 32) -> list[KVCacheEvent]:
    """One event of each kind, in turn."""
    out: list[KVCacheEvent] = []
    for i in ids:
        kind = i % 4
        if kind == 0:
            data: object = KVCacheStoredData(
                i - 1 if i % 8 else None,
                [
                    KVCacheStoredBlockData(
                        i * 10 + b, array("i", range(b, b + 16)), cache_salt="s" if b else None
                    )
                    for b in range(1 + i % 3)
                ],
            )
        elif kind == 1:
            data = KVCacheRemovedData([i, 2**64 - 1])
        elif kind == 2:
            data = KVCacheUpdatedData(i, cache_level=KVCacheEventDiff(0, 1))
        else:
            data = KVCacheCreatedData([i, 2])
        out.append(KVCacheEvent(i, data, window + i % 2, rank))  # type: ignore[arg-type]
    return out


@settings(max_examples=300, suppress_health_check=list(HealthCheck), deadline=None)
@given(batches)
def test_scan_finds_every_event_the_codec_wrote(batch: EventBatch) -> None:
    data = encode_batch(batch)
    scanned = scan_body(data, 10)
    assert scanned is not None
    dp_size, sequence, offset, dropped, start, stop, ends, ids, ranks, windows = scanned
    assert (dp_size, sequence, offset) == (
        batch.attention_dp_size,
        batch.sequence,
        batch.first_event_block_offset,
    )
    assert dropped == [(d.attention_dp_rank, d.dropped_events) for d in batch.dropped]
    parts = [encode_event(e) for e in batch.events]
    assert data[start:stop] == b"".join(parts)
    assert list(ends) == [sum(len(p) for p in parts[: k + 1]) for k in range(len(parts))]
    assert list(ids) == [e.event_id for e in batch.events]
    assert list(ranks) == [-1 if e.attention_dp_rank is None else e.attention_dp_rank for e in batch.events]
    assert list(windows) == [e.window_size for e in batch.events]


@settings(max_examples=200, suppress_health_check=list(HealthCheck), deadline=None)
@given(batches, st.data())
def test_a_cut_message_is_a_decode_error(batch: EventBatch, data: st.DataObject) -> None:
    whole = encode_batch(batch)
    cut = data.draw(st.integers(10, len(whole) - 1))
    with pytest.raises(DecodeError):
        scan_body(whole[:cut], 10)


def test_read_encoded_reads_what_read_batch_reads() -> None:
    sent = mixed(2, range(5, 45))
    for message in chunk_batches(
        sent, [RankDrops(2, 3)], instance_id="r2", attention_dp_size=4, first_sequence=7, max_events=16
    ):
        batch = read_batch(message, 2)
        encoded = read_encoded(bytearray(message), 2)
        assert encoded is not None
        assert (encoded.attention_dp_size, encoded.sequence, encoded.first_event_block_offset) == (
            4,
            batch.sequence,
            0,
        )
        assert encoded.dropped == batch.dropped
        assert encoded.events.decode() == batch.events
        assert list(encoded.windows) == [e.window_size for e in batch.events]
        check_encoded(encoded, 2, 4, 4)


def test_another_schema_version_is_left_to_the_decoder() -> None:
    message = bytearray(encode_batch(EventBatch("r1", mixed(1, range(3)), 2)))
    message[2] ^= 0xFF  # another fingerprint
    assert read_encoded(message, 1) is None


def test_malformed_bytes_are_a_protocol_error_naming_the_rank() -> None:
    message = encode_batch(EventBatch("r1", mixed(1, range(3)), 2))
    with pytest.raises(ProtocolError, match="rank 1 sent"):
        read_encoded(bytearray(message[:-3]), 1)


@pytest.mark.parametrize(
    "batch, last_id",
    [
        (EventBatch("r", mixed(1, range(3)), 3), -1),  # another DP size
        (EventBatch("r", mixed(1, range(3)), 2, first_event_block_offset=2), -1),  # a split event
        (EventBatch("r", mixed(1, range(3)), 2, dropped=[RankDrops(0, 1)]), -1),  # another's drops
        (EventBatch("r", mixed(1, range(3)) + mixed(0, range(3, 4)), 2), -1),  # another's event
        (EventBatch("r", mixed(1, range(3)) + mixed(None, range(3, 4)), 2), -1),  # no rank
        (EventBatch("r", mixed(1, range(3)), 2), 1),  # ids go back
        (EventBatch("r", mixed(1, range(3)) + mixed(1, range(2, 3)), 2), -1),  # ids repeat
        (EventBatch("r", mixed(1, range(3)), 2), -1),  # valid
    ],
)
def test_check_encoded_gives_check_batchs_verdict(batch: EventBatch, last_id: int) -> None:
    message = encode_batch(batch)
    encoded = read_encoded(bytearray(message), 1)
    assert encoded is not None
    try:
        check_batch(read_batch(message, 1), 1, 2, last_id)
    except ProtocolError as exc:
        with pytest.raises(ProtocolError) as caught:
            check_encoded(encoded, 1, 2, last_id)
        assert str(caught.value) == str(exc)
    else:
        check_encoded(encoded, 1, 2, last_id)


def encoded(events: list[KVCacheEvent]) -> tuple[EncodedEvents, array[int]]:
    out = EncodedEvents()
    encode_events(events, out)
    return out, array("i", [e.window_size for e in events])


@settings(max_examples=200, suppress_health_check=list(HealthCheck), deadline=None)
@given(
    st.integers(1, 40),
    st.lists(st.tuples(st.sampled_from([0, 1, 2, 3]), st.integers(0, 12)), max_size=12),
)
def test_encoded_events_are_truncated_and_counted_as_objects_are(
    capacity: int, steps: list[tuple[int, int]]
) -> None:
    """Rank 0's buffer: its own events as objects, the others' as bytes; against the same
    buffer fed only objects: same drops (per rank, per window, the newest dropped id told to
    the listeners), same events drained in the same order."""
    plain, mixed_buffer = EventBuffer(capacity), EventBuffer(capacity)
    heard: tuple[list[tuple[int, int, int | None]], list[tuple[int, int, int | None]]] = ([], [])
    plain.add_drop_listener(lambda *a: heard[0].append(a))
    mixed_buffer.add_drop_listener(lambda *a: heard[1].append(a))
    next_id = [0, 0, 0, 0]
    drained: tuple[list[KVCacheEvent], list[KVCacheEvent]] = ([], [])
    for rank, count in steps:
        if count == 0:  # a drain
            drained[0].extend(plain.drain(0).events)
            got = mixed_buffer.drain_encoded(0)
            drained[1].extend(got.events.decode() if isinstance(got.events, EncodedEvents) else got.events)
            continue
        sent = mixed(rank, range(next_id[rank], next_id[rank] + count))
        next_id[rank] += count
        assert plain.extend(sent) == (
            mixed_buffer.extend(sent) if rank == 0 else mixed_buffer.extend_encoded(*encoded(sent))
        )
        assert len(plain) == len(mixed_buffer)
    assert drained[0] == drained[1]
    assert plain.take(0) == mixed_buffer.take(0)
    a, b = plain.stats(), mixed_buffer.stats()
    assert a == b
    assert heard[0] == heard[1]


def test_drain_encoded_keeps_buffer_order_and_gives_objects_without_encoded_events() -> None:
    buffer = EventBuffer(100)
    buffer.extend(mixed(0, range(3)))
    assert not isinstance(buffer.drain_encoded(0).events, EncodedEvents)  # nothing encoded: objects
    own1, other, own2 = mixed(0, range(3, 6)), mixed(1, range(4)), mixed(0, range(6, 8))
    buffer.extend(own1)
    buffer.extend_encoded(*encoded(other))
    buffer.extend(own2)
    buffer.record_drops(1, 2, notify=False)  # after every buffered event: the next drain's
    drain = buffer.drain_encoded(0)
    assert isinstance(drain.events, EncodedEvents)
    assert drain.events.decode() == own1 + other + own2
    assert list(drain.events.ids) == [e.event_id for e in own1 + other + own2]
    assert drain.dropped == [] and len(buffer) == 0
    assert buffer.drain_encoded(0).dropped == [RankDrops(1, 2)]
