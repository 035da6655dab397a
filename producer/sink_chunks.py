"""Cut drained events into Kafka-sized chunks, and write a chunk as a message at hand-off time.

A *chunk* is the encoded events of one future message; its envelope (sequence, drops, ...) is
only known at hand-off, so :class:`EnvelopeWriter` encodes events once and later puts the
envelope in front (:func:`kvevents.schemas.codec.envelope_of`), falling back to re-encoding if
the schema does not allow it. :class:`Chunker` splits in order by size, cutting a Stored event
too large alone between blocks; what fits nowhere is returned as lost. Splitting and splicing
in detail: ``docs/WIRE_FORMAT.md``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import msgspec
from kvevents.schemas import (
    EncodeError,
    EventBatch,
    KVCacheEvent,
    KVCacheRemovedData,
    KVCacheStoredData,
    RankDrops,
    decode_batch,
    encode_batch,
)
from kvevents.schemas.codec import envelope_of

__all__ = [
    "DATA_ERRORS",
    "BatchCodec",
    "Chunk",
    "Chunker",
    "EnvelopeWriter",
    "Framed",
    "LostEvent",
    "SingleObjectCodec",
    "SplitEvent",
]

DATA_ERRORS = (EncodeError, ValueError, TypeError, OverflowError)
"""What an encoder raises for an event it cannot write (as opposed to, say, a registry outage)."""

I63_MAX = (1 << 63) - 1
"""The largest Avro long."""
_I31_MAX = (1 << 31) - 1
_PROBE = 64
"""Events encoded to estimate their size when a first drain is large."""
_FILL = 0.9
"""Aim chunks at this share of the budget, so that slices cut by estimate mostly fit at once."""


class Framed(Protocol):
    """Events encoded already (:class:`.sink_encoded.EncodedEvents`)."""

    def message(self, prefix: bytes) -> bytes:
        """``prefix`` followed by the events as an Avro array."""
        ...


class BatchCodec(Protocol):
    """Writes and reads whole framed messages (``kvevents.schemas.registry.RegistryCodec`` is one)."""

    def encode_batch(self, batch: EventBatch) -> bytes: ...

    def decode_batch(self, data: bytes | bytearray | memoryview) -> EventBatch: ...


class SingleObjectCodec:
    """The default framing: Avro single-object encoding (:func:`kvevents.schemas.encode_batch`)."""

    def encode_batch(self, batch: EventBatch) -> bytes:
        return encode_batch(batch)

    def decode_batch(self, data: bytes | bytearray | memoryview) -> EventBatch:
        return decode_batch(data)


def rank_of(event: KVCacheEvent) -> int:
    """The source rank an event is counted under (0 without attention DP)."""
    rank = event.attention_dp_rank
    return 0 if rank is None else rank


@dataclass(slots=True, eq=False)
class SplitEvent:
    """One Stored event cut into ``fragments`` messages; counts it exactly once as delivered
    (all fragments delivered) or lost (the first fragment lost, whichever it is)."""

    rank: int
    event_id: int
    fragments: int
    delivered: int = 0
    lost: bool = False

    def lose(self) -> int:
        """A fragment is lost: 1 the first time (the event counts as dropped), then 0."""
        if self.lost:
            return 0
        self.lost = True
        return 1

    def deliver(self) -> int:
        """A fragment was delivered: 1 when it completes an event nothing of which was lost."""
        self.delivered += 1
        return 1 if self.delivered == self.fragments and not self.lost else 0


@dataclass(slots=True, eq=False)
class Chunk:
    """The encoded events of one future message (Avro array: count, items, ``00``).

    ``by_rank``: whole events per source rank (empty for a fragment, which counts through its
    ``split``); ``last_event_ids``: the last event id per rank, for delivery reports.
    """

    part: memoryview
    events: int
    by_rank: dict[int, int]
    last_event_ids: dict[int, int]
    first_event_block_offset: int = 0
    split: SplitEvent | None = None
    envelope: EventBatch | None = None
    """The envelope ``part.obj`` was encoded with, when it is a whole message already (see
    :attr:`EnvelopeWriter.speculative`); None when it carries the template envelope."""
    number: int = -1
    """Its place in the sink's queue (:attr:`ChunkQueue.pushed` when it was pushed; the pieces
    of a re-split chunk share it); -1 for a batch with no events, made when the queue is empty."""

    @property
    def size(self) -> int:
        return len(self.part)

    def encoded_message(self) -> bytes:
        """The whole message ``part`` is a view of (meaningful when :attr:`envelope` is set)."""
        whole = self.part.obj
        if not isinstance(whole, bytes):
            raise TypeError(f"a chunk's part must view a bytes object, not {type(whole).__name__}")
        return whole


EMPTY_EVENTS = memoryview(b"\x00")
"""An empty Avro array: the events of a batch that only reports drops."""


@dataclass(frozen=True, slots=True)
class LostEvent:
    """An event the chunker could not put in any message: too large or not encodable."""

    rank: int
    event_id: int
    reason: str
    """``oversized`` or ``unencodable``."""
    detail: str


class EnvelopeWriter:
    """Encodes events without an envelope, and puts one in front of them at hand-off time."""

    def __init__(self, codec: BatchCodec, instance_id: str, attention_dp_size: int) -> None:
        self._codec = codec
        self._instance_id = instance_id
        self._dp_size = attention_dp_size
        self._template_prefix: bytes | None = None
        self._splice: bool | None = None
        self._max_prefix: int | None = None
        self.speculative: Callable[[int], EventBatch | None] | None = None
        """Called with a first-event block offset before each encoding: the envelope the message
        will most likely be produced with (or None). Encoding with it makes ``part.obj`` the
        finished message, which the sink then produces as it is when the guess holds."""
        self.last_envelope: EventBatch | None = None
        """The envelope the last :meth:`events_part` encoded with (None: the template)."""

    @property
    def splices(self) -> bool | None:
        """Whether messages are assembled by splicing (None until first used)."""
        return self._splice

    def template_prefix(self) -> bytes:
        """The envelope :meth:`events_part` strips: ``template_prefix() + part`` is a whole message."""
        if self._template_prefix is None:
            empty = self._codec.encode_batch(EventBatch(self._instance_id, [], self._dp_size))
            try:
                self._template_prefix = envelope_of(empty)
            except EncodeError as exc:
                raise RuntimeError(f"the codec cannot cut a message's events from it: {exc}") from None
        return self._template_prefix

    def events_part(self, events: Sequence[KVCacheEvent], first_event_block_offset: int = 0) -> memoryview:
        """The Avro encoding of ``events`` as a batch's events array (a view into the encoded
        message: no copy)."""
        prefix = self.template_prefix()
        envelope = self._speculated(first_event_block_offset)
        if envelope is not None:
            full = self._codec.encode_batch(msgspec.structs.replace(envelope, events=list(events)))
            return memoryview(full)[len(envelope_of(self._codec.encode_batch(envelope))) :]
        full = self._codec.encode_batch(EventBatch(self._instance_id, list(events), self._dp_size))
        if not full.startswith(prefix):
            raise RuntimeError("the codec wrote a different envelope for the same envelope fields")
        return memoryview(full)[len(prefix) :]

    def encoded_part(self, events: Framed, first_event_block_offset: int = 0) -> memoryview:
        """:meth:`events_part` for events encoded already: their bytes spliced after the envelope
        (the template's, or the speculated one's)."""
        prefix = self.template_prefix()
        envelope = self._speculated(first_event_block_offset)
        if envelope is not None:
            prefix = envelope_of(self._codec.encode_batch(envelope))
        return memoryview(events.message(prefix))[len(prefix) :]

    def _speculated(self, first_event_block_offset: int) -> EventBatch | None:
        """The envelope to encode the next part with (see :attr:`speculative`), also kept as
        :attr:`last_envelope`."""
        envelope = None
        if self.speculative is not None:
            if self._splice is None:
                self._splice = self._check_splice()
            if self._splice:
                envelope = self.speculative(first_event_block_offset)
        self.last_envelope = envelope
        return envelope

    def _envelope(
        self, producer_id: int, sequence: int, created_at_us: int, dropped: list[RankDrops], offset: int
    ) -> EventBatch:
        return EventBatch(
            self._instance_id,
            [],
            attention_dp_size=self._dp_size,
            producer_id=producer_id,
            sequence=sequence,
            created_at_us=created_at_us,
            dropped=dropped,
            first_event_block_offset=offset,
        )

    def message(
        self,
        part: bytes | memoryview,
        *,
        producer_id: int,
        sequence: int,
        created_at_us: int,
        dropped: list[RankDrops],
        first_event_block_offset: int,
    ) -> bytes:
        """The framed message: the envelope, then the events ``part`` encoded earlier."""
        if self._splice is None:
            self._splice = self._check_splice()
        envelope = self._envelope(producer_id, sequence, created_at_us, dropped, first_event_block_offset)
        if self._splice:
            return envelope_of(self._codec.encode_batch(envelope)) + part
        events = self._codec.decode_batch(self.template_prefix() + part).events
        return self._codec.encode_batch(msgspec.structs.replace(envelope, events=events))

    def max_prefix_size(self) -> int:
        """An upper bound of the envelope's encoded size before the events array, for a batch
        reporting drops of up to ``attention_dp_size`` ranks."""
        if self._max_prefix is None:
            ranks = max(1, self._dp_size)
            dropped = [RankDrops(_I31_MAX, I63_MAX) for _ in range(ranks)]
            envelope = self._envelope(I63_MAX, I63_MAX, I63_MAX, dropped, _I31_MAX)
            self._max_prefix = len(envelope_of(self._codec.encode_batch(envelope)))
        return self._max_prefix

    def _check_splice(self) -> bool:
        speculative, self.speculative = self.speculative, None  # the probe uses the template
        try:
            return self._splice_holds()
        finally:
            self.speculative = speculative

    def _splice_holds(self) -> bool:
        probe = [
            KVCacheEvent(7, KVCacheRemovedData([1, 2**64 - 1]), 32, 1),
            KVCacheEvent(8, KVCacheRemovedData([3]), 16, None),
        ]
        fields = {
            "producer_id": 2**62 + 3,
            "sequence": 300,
            "created_at_us": 1_700_000_000_000_000,
            "dropped": [RankDrops(1, 5)],
            "first_event_block_offset": 2,
        }
        direct = self._codec.encode_batch(
            EventBatch(self._instance_id, probe, attention_dp_size=self._dp_size, **fields)  # type: ignore[arg-type]
        )
        envelope = self._envelope(
            fields["producer_id"],  # type: ignore[arg-type]
            fields["sequence"],  # type: ignore[arg-type]
            fields["created_at_us"],  # type: ignore[arg-type]
            fields["dropped"],  # type: ignore[arg-type]
            fields["first_event_block_offset"],  # type: ignore[arg-type]
        )
        spliced = envelope_of(self._codec.encode_batch(envelope)) + self.events_part(probe)
        return spliced == direct


@dataclass(slots=True)
class Chunker:
    """Cuts events into chunks whose encoded events fit ``budget`` bytes (see module doc).

    ``single_rank``: every event has the same source rank (a manager without attention DP), which
    spares a loop over the events to count them per rank.
    """

    writer: EnvelopeWriter
    single_rank: bool = False
    max_events: int = 1 << 30
    """At most this many events per chunk: bounds how long one encoding holds the GIL."""
    bytes_per_event: float = field(default=0.0)
    """Running estimate, used to cut large drains into slices before encoding them."""

    def chunks(self, events: Sequence[KVCacheEvent], budget: int) -> Iterator[Chunk | LostEvent]:
        """Chunks (and lost events) for ``events``, in order; each chunk's ``part`` <= ``budget``."""
        if budget < 16:
            raise ValueError(f"a message budget of {budget} bytes cannot hold any event")
        n = len(events)
        if n == 0:
            return
        if self.bytes_per_event <= 0 and n > _PROBE:
            # a first large drain: learn the size of an event from a few, rather than encoding
            # everything once only to cut it and encode it again
            self.bytes_per_event = len(self._part(events[:_PROBE])) / _PROBE
        estimate = self.bytes_per_event
        step = self.max_events
        if estimate > 0 and n * estimate > 2 * budget:
            step = min(step, max(1, int(budget * _FILL / estimate)))
        if n > step:
            for start in range(0, n, step):
                yield from self._fit(events[start : start + step], budget)
        else:
            yield from self._fit(events, budget)

    def _fit(self, events: Sequence[KVCacheEvent], budget: int) -> Iterator[Chunk | LostEvent]:
        n = len(events)
        try:
            part = self._part(events)
        except DATA_ERRORS as exc:
            if n == 1:
                event = events[0]
                yield LostEvent(rank_of(event), event.event_id, "unencodable", str(exc))
                return
            half = n // 2
            yield from self._fit(events[:half], budget)
            yield from self._fit(events[half:], budget)
            return
        size = len(part)
        self.bytes_per_event = size / n
        if size <= budget:
            chunk = self._chunk(events, part)
            chunk.envelope = self.writer.last_envelope
            yield chunk
            return
        if n == 1:
            yield from self._split_event(events[0], budget, size)
            return
        pieces = max(2, math.ceil(size / (budget * _FILL)))
        step = math.ceil(n / pieces)
        for start in range(0, n, step):
            yield from self._fit(events[start : start + step], budget)

    def _part(self, events: Sequence[KVCacheEvent]) -> memoryview:
        """The encoded events array of ``events`` (a subclass may take them pre-encoded)."""
        return self.writer.events_part(events)

    def _chunk(self, events: Sequence[KVCacheEvent], part: memoryview) -> Chunk:
        if self.single_rank:
            last = events[-1]
            rank = rank_of(last)
            return Chunk(part, len(events), {rank: len(events)}, {rank: last.event_id})
        by_rank: dict[int, int] = {}
        last_ids: dict[int, int] = {}
        for event in events:
            source = event.attention_dp_rank
            if source is None:
                source = 0
            by_rank[source] = by_rank.get(source, 0) + 1
            last_ids[source] = event.event_id
        return Chunk(part, len(events), by_rank, last_ids)

    # -- one event too large for a message ----------------------------------------------------

    def _split_event(self, event: KVCacheEvent, budget: int, size: int) -> Iterator[Chunk | LostEvent]:
        data = event.data
        rank = rank_of(event)
        if not isinstance(data, KVCacheStoredData) or len(data.blocks) < 2:
            kind = type(data).__name__
            yield LostEvent(
                rank, event.event_id, "oversized",
                f"a {kind} event of {size} bytes does not fit the message budget of {budget} bytes",
            )  # fmt: skip
            return
        pieces: list[tuple[int, memoryview, EventBatch | None]] = []
        try:
            self._fragments(event, data, 0, len(data.blocks), budget, size, pieces)
        except _BlockTooLarge as exc:
            yield LostEvent(rank, event.event_id, "oversized", str(exc))
            return
        split = SplitEvent(rank, event.event_id, len(pieces))
        for start, part, envelope in pieces:
            yield Chunk(part, 1, {}, {rank: event.event_id}, start, split, envelope)

    def _fragments(
        self,
        event: KVCacheEvent,
        data: KVCacheStoredData,
        start: int,
        end: int,
        budget: int,
        size: int,
        out: list[tuple[int, memoryview, EventBatch | None]],
    ) -> None:
        """Append ``(first block index, part)`` for blocks ``start:end`` (encoded ``size`` bytes
        together) cut into fragments that fit, in order."""
        count = end - start
        pieces = max(2, math.ceil(size / (budget * _FILL)))
        step = math.ceil(count / pieces)
        for lo in range(start, end, step):
            hi = min(end, lo + step)
            part = self.writer.events_part([_fragment(event, data, lo, hi)], lo)
            if len(part) <= budget:
                out.append((lo, part, self.writer.last_envelope))
            elif hi - lo == 1:
                raise _BlockTooLarge(
                    f"block {lo} of Stored event {event.event_id} alone needs {len(part)} bytes, "
                    f"over the message budget of {budget} bytes"
                )
            else:
                self._fragments(event, data, lo, hi, budget, len(part), out)


class _BlockTooLarge(Exception):
    pass


def _fragment(event: KVCacheEvent, data: KVCacheStoredData, start: int, end: int) -> KVCacheEvent:
    """Blocks ``start:end`` of a Stored event, as the event a consumer reassembles them from."""
    parent = data.parent_hash if start == 0 else data.blocks[start - 1].block_hash
    return KVCacheEvent(
        event.event_id,
        KVCacheStoredData(parent, data.blocks[start:end]),
        event.window_size,
        event.attention_dp_rank,
    )
