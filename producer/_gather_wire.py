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
from array import array
from collections.abc import Sequence
from enum import IntEnum

from kvevents.schemas import DecodeError, EventBatch, KVCacheEvent, RankDrops, decode_batch, encode_batch
from kvevents.schemas.codec import current_fingerprint

from .sink_encoded import EncodedEvents, scan_body

__all__ = [
    "RESYNC_FORMAT",
    "EncodedBatch",
    "ProtocolError",
    "Tag",
    "check_batch",
    "check_encoded",
    "chunk_batches",
    "decode_resync",
    "encode_resync",
    "read_batch",
    "read_encoded",
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


def _check_header(batch: EventBatch | EncodedBatch, source_rank: int, attention_dp_size: int) -> None:
    """The rules on a message's batch fields (both readers): the DP size, no split, own drops."""
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


def check_batch(batch: EventBatch, source_rank: int, attention_dp_size: int, last_event_id: int) -> None:
    """Raise :class:`ProtocolError` unless ``batch`` is a valid message of ``source_rank``:
    every event and drop count is that rank's, event ids increase strictly and continue after
    ``last_event_id`` (-1 before the first), the DP size matches, no split Stored event."""
    _check_header(batch, source_rank, attention_dp_size)
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


class EncodedBatch:
    """A gather message read without building its events (:func:`read_encoded`): the envelope
    fields rank 0 checks, and the events as the rank encoded them, with their window sizes."""

    __slots__ = ("attention_dp_size", "dropped", "events", "first_event_block_offset", "sequence", "windows")

    def __init__(
        self,
        attention_dp_size: int,
        sequence: int,
        first_event_block_offset: int,
        dropped: list[RankDrops],
        events: EncodedEvents,
        windows: array[int],
    ) -> None:
        self.attention_dp_size = attention_dp_size
        self.sequence = sequence
        self.first_event_block_offset = first_event_block_offset
        self.dropped = dropped
        self.events = events
        self.windows = windows


_HEADER = b"\xc3\x01" + current_fingerprint()
"""The single-object header of a message of the current schema."""


def read_encoded(data: bytearray, source_rank: int) -> EncodedBatch | None:
    """:func:`read_batch` without decoding the events (rank 0's pass-through to Kafka): the
    whole body is checked as the decoder would (:class:`ProtocolError` when malformed), and the
    events' bytes are kept (``data`` is consumed: its bytes become the events'). None when this
    cannot be done here (the compiled reader is not built, the message is another schema
    version's, or its events array is laid out otherwise): then call :func:`read_batch`."""
    if scan_body is None or not data.startswith(_HEADER):
        return None
    try:
        scanned = scan_body(data, 10)
    except DecodeError as exc:
        raise ProtocolError(f"rank {source_rank} sent {len(data)} bytes that do not decode: {exc}") from exc
    if scanned is None:
        return None
    dp_size, sequence, offset, dropped, start, stop, ends, ids, ranks, windows = scanned
    del data[stop:]  # in place: no copy of the events' bytes
    del data[:start]
    events = EncodedEvents.__new__(EncodedEvents)  # a whole one, over these arrays
    events.data, events.ends, events.ids, events.ranks = data, ends, ids, ranks
    events._start, events._stop = 0, -1
    drops = [RankDrops(r, n) for r, n in dropped] if dropped else []
    return EncodedBatch(dp_size, sequence, offset, drops, events, windows)


def check_encoded(batch: EncodedBatch, source_rank: int, attention_dp_size: int, last_event_id: int) -> None:
    """:func:`check_batch` for an :class:`EncodedBatch`: the same rules, the same errors."""
    _check_header(batch, source_rank, attention_dp_size)
    events = batch.events
    ranks = events.ranks
    if ranks.count(source_rank) != len(ranks):
        k = next(i for i, rank in enumerate(ranks) if rank != source_rank)
        rank = None if ranks[k] < 0 else ranks[k]
        raise ProtocolError(f"rank {source_rank} sent event {events.ids[k]} of attention_dp_rank {rank!r}")
    previous = last_event_id
    for event_id in events.ids:
        if event_id <= previous:
            raise ProtocolError(
                f"rank {source_rank} sent event id {event_id} after {previous}: ids must increase"
            )
        previous = event_id
