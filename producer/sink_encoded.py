"""Pre-encoded input for ``KafkaEventSink``: events a source already wrote as Avro bytes.

:class:`EncodedEvents` holds events of the current schema back to back in one buffer, with each
one's end offset, event id and source rank: the sink cuts messages between them and splices
their bytes after the envelope, with no Python object per event. A source offers them with
``drain_encoded(timeout) -> EncodedDrain``. Chunks are cut exactly as :class:`.sink_chunks.Chunker`
cuts the same events as objects (same sizes, same estimates), so the messages are the same bytes;
a Stored event too large for one message is decoded and split as an object. Design:
``docs/ARCHITECTURE.md`` (pre-encoded path).
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Sequence
from typing import Protocol, overload

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
)
from kvevents.schemas.codec import decode_body, encode_body

from .buffer import EventDrain
from .sink_chunks import Chunk, Chunker

__all__ = [
    "EncodedChunker",
    "EncodedDrain",
    "EncodedEventSource",
    "EncodedEvents",
    "encode_events",
    "scan_body",
    "varint_of",
]

try:
    from ._gatherscan import extend_shifted, rank_tallies, scan_body
except ImportError:  # not built: the callers take their object paths, these loop in Python
    extend_shifted = rank_tallies = scan_body = None  # type: ignore[assignment]

_PROBE = [
    KVCacheEvent(7, KVCacheRemovedData([1, 2**64 - 1]), 32, 1),
    KVCacheEvent(
        8,
        KVCacheStoredData(5, [KVCacheStoredBlockData(9, array("i", [1, -2]), cache_level=1, cache_salt="s")]),
        16,
        None,
    ),
    KVCacheEvent(9, KVCacheUpdatedData(9, cache_level=KVCacheEventDiff(1, 0)), 16, 0),
    KVCacheEvent(10, KVCacheCreatedData([]), 0, 2),
]
_BODY_PREFIX = encode_body(EventBatch("", [], 1))[:-1]
"""The body of an empty batch (no instance id, no drops) without its empty events array."""


def varint_of(n: int) -> bytes:
    """Avro's encoding of the long ``n`` >= 0 (zig-zag, then 7 bits a byte)."""
    z = n << 1
    out = bytearray()
    while z >= 0x80:
        out.append((z & 0x7F) | 0x80)
        z >>= 7
    out.append(z)
    return bytes(out)


def encode_event(event: KVCacheEvent) -> bytes:
    """The Avro encoding of one event (as an item of ``EventBatch.events``); raises EncodeError."""
    body = encode_body(EventBatch("", [event], 1))
    return body[len(_BODY_PREFIX) + 1 : -1]  # after the envelope and the count 1, before the end 00


def encode_events(events: list[KVCacheEvent], out: EncodedEvents) -> None:
    """Append ``events`` to ``out``, encoded together (one codec call, then :func:`scan_body`
    finds where each ends) when the compiled reader is built, else one by one."""
    if scan_body is not None:
        body = encode_body(EventBatch("", events, 1))
        scanned = scan_body(body, 0)
        if scanned is not None:
            start, stop, ends, ids, ranks = scanned[4:9]
            out.extend_raw(memoryview(body)[start:stop], ends, ids, ranks)
            return
    out.add(events)


class EncodedEvents(Sequence[KVCacheEvent]):
    """Avro-encoded events in order: ``data`` their bytes back to back, ``ends`` the end offset of
    each, ``ids`` and ``ranks`` (-1: None) their event ids and source ranks. Slicing gives a view
    (no copy); an index gives the event decoded (for the rare paths). Only a whole object (not a
    view) is appended to."""

    __slots__ = ("_start", "_stop", "data", "ends", "ids", "ranks")

    def __init__(self) -> None:
        self.data = bytearray()
        self.ends: array[int] = array("q")
        self.ids: array[int] = array("q")
        self.ranks: array[int] = array("i")
        self._start = 0
        self._stop = -1  # -1: to the end (a whole object)

    @classmethod
    def of(cls, events: Iterable[KVCacheEvent]) -> EncodedEvents:
        out = cls()
        out.add(events)
        return out

    # -- building --------------------------------------------------------------------------

    def add(self, events: Iterable[KVCacheEvent]) -> None:
        """Append ``events``, each encoded here (the Python paths' events); EncodeError leaves
        the events before the bad one appended."""
        self._whole()
        for event in events:
            encoded = encode_event(event)
            self.data += encoded
            self.ends.append(len(self.data))
            self.ids.append(event.event_id)
            rank = event.attention_dp_rank
            self.ranks.append(-1 if rank is None else rank)

    def extend_raw(
        self, data: bytes | bytearray | memoryview, ends: array[int], ids: array[int], ranks: array[int]
    ) -> None:
        """Append events given as their bytes back to back (``data``), each one's end offset in
        ``data``, id and rank (-1: None), as :func:`scan_body` reads them."""
        self._whole()
        base = len(self.data)
        self.data += data
        if not base:
            self.ends.extend(ends)
        elif extend_shifted is not None:
            extend_shifted(self.ends, ends, 0, len(ends), base)
        else:
            self.ends.extend(end + base for end in ends)
        self.ids.extend(ids)
        self.ranks.extend(ranks)

    def extend(self, other: EncodedEvents) -> None:
        """Append the events of ``other`` (a whole object or a view)."""
        self._whole()
        a, b = other._span()
        if a == b:
            return
        lo = other._offset(a)
        base = len(self.data) - lo
        self.data += memoryview(other.data)[lo : other.ends[b - 1]]
        if extend_shifted is not None:
            extend_shifted(self.ends, other.ends, a, b, base)
        else:
            self.ends.extend(end + base for end in other.ends[a:b])
        self.ids.extend(other.ids[a:b])
        self.ranks.extend(other.ranks[a:b])

    def clear(self) -> None:
        self._whole()
        del self.data[:]
        del self.ends[:], self.ids[:], self.ranks[:]

    # -- reading ---------------------------------------------------------------------------

    def __len__(self) -> int:
        a, b = self._span()
        return b - a

    @overload
    def __getitem__(self, index: int) -> KVCacheEvent: ...
    @overload
    def __getitem__(self, index: slice) -> EncodedEvents: ...
    def __getitem__(self, index: int | slice) -> KVCacheEvent | EncodedEvents:
        a, b = self._span()
        if isinstance(index, slice):
            start, stop, step = index.indices(b - a)
            if step != 1:
                raise ValueError("EncodedEvents slices have no step")
            view = EncodedEvents.__new__(EncodedEvents)
            view.data, view.ends, view.ids, view.ranks = self.data, self.ends, self.ids, self.ranks
            view._start, view._stop = a + start, a + max(start, stop)
            return view
        k = index + (b - a) if index < 0 else index
        if not 0 <= k < b - a:
            raise IndexError("EncodedEvents index out of range")
        return self[k : k + 1].decode()[0]

    def event_id(self, k: int) -> int:
        return self.ids[self._span()[0] + k]

    def rank(self, k: int) -> int:
        """The rank event ``k`` is counted under (0 without attention DP)."""
        rank = self.ranks[self._span()[0] + k]
        return 0 if rank < 0 else rank

    @property
    def nbytes(self) -> int:
        a, b = self._span()
        return 0 if a == b else self.ends[b - 1] - self._offset(a)

    def message(self, prefix: bytes) -> bytes:
        """``prefix`` followed by these events as an Avro array (count, items, end)."""
        a, b = self._span()
        if a == b:
            return prefix + b"\x00"
        body = memoryview(self.data)[self._offset(a) : self.ends[b - 1]]
        return b"".join((prefix, varint_of(b - a), body, b"\x00"))

    def decode(self) -> list[KVCacheEvent]:
        """The events as objects."""
        return decode_body(self.message(_BODY_PREFIX)).events

    def count_by_rank(self) -> dict[int, int]:
        a, b = self._span()
        if rank_tallies is not None:
            return rank_tallies(self.ranks, self.ids, a, b)[0]
        counts: dict[int, int] = {}
        for rank in self.ranks[a:b]:
            key = 0 if rank < 0 else rank
            counts[key] = counts.get(key, 0) + 1
        return counts

    def last_ids(self) -> tuple[dict[int, int], dict[int, int]]:
        """Per rank: how many events, and the last event id."""
        a, b = self._span()
        if rank_tallies is not None:
            return rank_tallies(self.ranks, self.ids, a, b)
        by_rank: dict[int, int] = {}
        last: dict[int, int] = {}
        for rank, event_id in zip(self.ranks[a:b], self.ids[a:b], strict=True):
            key = 0 if rank < 0 else rank
            by_rank[key] = by_rank.get(key, 0) + 1
            last[key] = event_id
        return by_rank, last

    def _span(self) -> tuple[int, int]:
        return self._start, (len(self.ends) if self._stop < 0 else self._stop)

    def _offset(self, k: int) -> int:
        return self.ends[k - 1] if k > 0 else 0

    def _whole(self) -> None:
        if self._start != 0 or self._stop >= 0:
            raise ValueError("a view of EncodedEvents cannot be changed")

    def __repr__(self) -> str:
        return f"EncodedEvents({len(self)} events, {self.nbytes} bytes)"


class EncodedDrain:
    """What a pre-encoded source's ``drain_encoded`` took: the events (pre-encoded, or objects)
    and, per source rank, the events it dropped since the previous drain, and ``more`` (drain
    again at once), as ``EventDrain``."""

    __slots__ = ("dropped", "events", "more")

    def __init__(self, events: Sequence[KVCacheEvent], dropped: list[RankDrops], more: bool = False) -> None:
        self.events = events
        self.dropped = dropped
        self.more = more


class EncodedEventSource(Protocol):
    """A source the sink drains through ``drain_encoded`` instead of ``drain``."""

    def drain_encoded(self, timeout: float | None = None) -> EncodedDrain | EventDrain: ...


class EncodedChunker(Chunker):
    """:class:`Chunker` over :class:`EncodedEvents`: the same cuts, the bytes spliced. If the
    sink's codec writes events otherwise (checked once on a probe), they are decoded and
    encoded by it instead."""

    splices_encoded: bool | None = None

    def _part(self, events: Sequence[KVCacheEvent]) -> memoryview:
        if isinstance(events, EncodedEvents):
            if self.splices_encoded is None:
                self.splices_encoded = self._same_bytes()
            if self.splices_encoded:
                return self.writer.encoded_part(events)
            events = events.decode()
        return super()._part(events)

    def _same_bytes(self) -> bool:
        writer = self.writer
        speculative, writer.speculative = writer.speculative, None  # the probe uses the template
        try:
            return bytes(writer.events_part(_PROBE)) == bytes(writer.encoded_part(EncodedEvents.of(_PROBE)))
        finally:
            writer.speculative = speculative

    def _chunk(self, events: Sequence[KVCacheEvent], part: memoryview) -> Chunk:
        if not isinstance(events, EncodedEvents):
            return super()._chunk(events, part)
        n = len(events)
        if self.single_rank:
            rank = events.rank(n - 1)
            return Chunk(part, n, {rank: n}, {rank: events.event_id(n - 1)})
        by_rank, last = events.last_ids()
        return Chunk(part, n, by_rank, last)
