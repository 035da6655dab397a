"""What the attention-DP gather puts on the wire, and how rank 0 checks what it receives.

Every message is an MPI byte message on the gather's own communicator. A message that carries
events is an Avro single-object encoded ``EventBatch`` (``kvevents.schemas.encode_batch``):
never pickle, so a payload from another process cannot run code. Control messages are empty;
their MPI tag says what they mean. The tags are listed in :class:`Tag`.

Pure functions: no MPI here, so they are unit-tested without processes.
"""

from __future__ import annotations

import struct
import time
from collections.abc import Sequence
from enum import IntEnum

from kvevents.schemas import DecodeError, EventBatch, KVCacheEvent, RankDrops, decode_batch, encode_batch

__all__ = [
    "RESYNC_FORMAT",
    "ProtocolError",
    "Tag",
    "check_batch",
    "chunk_batches",
    "decode_resync",
    "encode_resync",
    "read_batch",
]


class Tag(IntEnum):
    """MPI tags of the gather protocol (on its private communicator)."""

    EVENTS = 1
    """rank r -> 0: an EventBatch of rank r's events and drops."""
    HEARTBEAT = 2
    """rank r -> 0, empty: rank r is alive and had nothing to send."""
    BYE = 3
    """rank r -> 0: rank r's last EventBatch (possibly without events); it leaves the gather."""
    STOP = 4
    """0 -> rank r, empty: the gather is stopping; send your last events (BYE) and leave."""
    BYE_ACK = 5
    """0 -> rank r, empty: rank 0 has merged everything up to your BYE; you may go."""
    RESYNC = 6
    """0 -> rank r, :data:`RESYNC_FORMAT`: rank 0 (its buffer, its Kafka sink) lost events of
    rank r after they left it; rank r's engine should publish a snapshot."""


class ProtocolError(ValueError):
    """A decoded message breaks the gather's rules (wrong rank, order, size ...)."""


_FILL = 0.9
"""Byte-bounded messages aim at this share of ``max_bytes``, so that most fit at the first try."""

RESYNC_FORMAT = struct.Struct("<qq")
"""A RESYNC payload: events lost, and the newest lost event id (-1: not known)."""


def encode_resync(lost_events: int, newest_event_id: int | None) -> bytes:
    """The payload of a RESYNC message."""
    return RESYNC_FORMAT.pack(lost_events, -1 if newest_event_id is None else newest_event_id)


def decode_resync(data: bytes | bytearray) -> tuple[int, int | None]:
    """(events lost, newest lost event id or None) of a RESYNC payload; ProtocolError if malformed."""
    if len(data) != RESYNC_FORMAT.size:
        raise ProtocolError(f"a RESYNC message has {RESYNC_FORMAT.size} bytes, got {len(data)}")
    lost, newest = RESYNC_FORMAT.unpack(data)
    if lost < 0 or newest < -1:
        raise ProtocolError(f"a RESYNC message with lost={lost}, newest_event_id={newest}")
    return lost, (None if newest == -1 else newest)


def chunk_batches(
    events: Sequence[KVCacheEvent],
    dropped: list[RankDrops],
    *,
    instance_id: str,
    attention_dp_size: int,
    first_sequence: int,
    max_events: int,
    max_bytes: int | None = None,
    max_messages: int | None = None,
) -> list[bytes]:
    """Encode ``events`` (oldest first) as consecutive ``EventBatch`` messages of at most
    ``max_events`` events and, unless one event alone is larger, at most ``max_bytes`` bytes
    (None: no bound), numbered from ``first_sequence``; the drops go with the first. Always at
    least one message (an empty batch when there are neither events nor drops).

    ``max_messages``: when the events would need more messages than this at ``max_bytes``, the
    byte bound grows to fit them in about that many (a backlog goes in fewer, larger messages:
    each send costs its thread a GIL round trip)."""
    created_at_us = time.time_ns() // 1000
    messages: list[bytes] = []
    count = len(events)
    start = 0
    per_message = max_events
    while start < count or not messages:
        n = min(per_message, count - start)
        while True:
            data = encode_batch(
                EventBatch(
                    instance_id,
                    list(events[start : start + n]),
                    attention_dp_size=attention_dp_size,
                    sequence=first_sequence + len(messages),
                    created_at_us=created_at_us,
                    dropped=[] if messages else dropped,
                )
            )
            if not messages and max_bytes is not None and max_messages is not None and n:
                # A backlog: the byte bound grows so that it goes in about max_messages messages.
                max_bytes = max(max_bytes, len(data) * count // (n * max_messages) + 1)
            if max_bytes is None or len(data) <= max_bytes or n <= 1:
                break
            # Too large: fewer events, in proportion to the overshoot (with a margin).
            n = max(1, min(n - 1, int(n * max_bytes * _FILL / len(data))))
        messages.append(data)
        start += n
        if max_bytes is not None and n:
            # The next message aims at what this one's events weighed (never above max_events).
            per_message = max(1, min(max_events, int(max_bytes * _FILL * n / len(data))))
    return messages


def check_batch(batch: EventBatch, source_rank: int, attention_dp_size: int, last_event_id: int) -> None:
    """Raise :class:`ProtocolError` unless ``batch`` is a valid message of ``source_rank``:
    every event and drop count is that rank's, event ids increase strictly and continue after
    ``last_event_id`` (-1 before the first), the DP size matches, no split Stored event."""
    if batch.attention_dp_size != attention_dp_size:
        raise ProtocolError(
            f"rank {source_rank} sent attention_dp_size={batch.attention_dp_size}, expected {attention_dp_size}"
        )
    if batch.first_event_block_offset:
        raise ProtocolError(
            f"rank {source_rank} sent a split Stored event (first_event_block_offset="
            f"{batch.first_event_block_offset}); the gather never splits events"
        )
    for drops in batch.dropped:
        if drops.attention_dp_rank != source_rank or drops.dropped_events < 0:
            raise ProtocolError(f"rank {source_rank} reported drops {drops!r} that are not its own")
    previous = last_event_id
    for event in batch.events:
        if event.attention_dp_rank != source_rank:
            raise ProtocolError(
                f"rank {source_rank} sent event {event.event_id} of attention_dp_rank {event.attention_dp_rank!r}"
            )
        if event.event_id <= previous:
            raise ProtocolError(
                f"rank {source_rank} sent event id {event.event_id} after {previous}: ids must increase"
            )
        previous = event.event_id


def read_batch(data: bytes | bytearray | memoryview, source_rank: int) -> EventBatch:
    """Decode one message of ``source_rank``; :class:`ProtocolError` naming the rank if the bytes
    are not an ``EventBatch`` (the codec's ``DecodeError`` is the cause)."""
    try:
        return decode_batch(data)
    except DecodeError as exc:
        raise ProtocolError(f"rank {source_rank} sent {len(data)} bytes that do not decode: {exc}") from exc
