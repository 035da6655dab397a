"""The Kafka sink's bounded queue of chunks, and its ledger of lost events.

:class:`ChunkQueue` drops the OLDEST chunks past ``max_events``/``max_bytes`` (with a fragment,
its queued siblings) and hands them back to be counted. :class:`LossLedger` keeps every lost
event, per source rank, *pending* until a produced batch carries it in ``EventBatch.dropped``
and *reported* once that batch is delivered (pending again if it fails), so every lost event is
at any moment pending or reported in exactly one delivered batch (``docs/OPERATIONS.md``).
A loss is carried only by a batch whose events all came after the lost ones (a consumer takes
the loss to precede the batch's events): one recorded while older chunks wait in the queue
waits for a chunk queued after it, or for a batch with no events; a lost chunk's loss may ride
with any chunk queued after that chunk (the sink says which with ``after``).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping

from kvevents.schemas import RankDrops

from .sink_chunks import I63_MAX, Chunk

__all__ = ["LOSS_REASONS", "MAX_REPORTED", "ChunkQueue", "LossLedger"]

MAX_REPORTED = I63_MAX
"""The most lost events one batch reports per rank (``RankDrops.dropped_events`` is an Avro long)."""

LOSS_REASONS = (
    "queue_full",
    "delivery_failed",
    "produce_failed",
    "oversized",
    "unencodable",
    "unsent_at_close",
)
"""Why the sink lost events: its queue overflowed (oldest first); librdkafka reported a failed
delivery; ``produce`` refused the message; an event fits no message; an event cannot be encoded;
the sink closed before the event was delivered."""


class ChunkQueue:
    """Chunks waiting for librdkafka, oldest first; bounded in events and bytes, drops oldest."""

    def __init__(self, max_events: int, max_bytes: int) -> None:
        for name, value in (("max_events", max_events), ("max_bytes", max_bytes)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        self.max_events = max_events
        self.max_bytes = max_bytes
        self._chunks: deque[Chunk] = deque()
        self.pushed = 0
        """Chunks pushed so far: the next chunk's :attr:`Chunk.number`."""
        self.events = 0
        self.bytes = 0
        self.high_water_events = 0

    def __len__(self) -> int:
        return len(self._chunks)

    def __bool__(self) -> bool:
        return bool(self._chunks)

    def push(self, chunk: Chunk) -> list[Chunk]:
        """Append ``chunk`` (numbering it); return the chunks dropped to stay within the bounds,
        oldest first."""
        chunk.number = self.pushed
        self.pushed += 1
        self._chunks.append(chunk)
        self.events += chunk.events
        self.bytes += chunk.size
        if self.events > self.high_water_events:
            self.high_water_events = self.events
        dropped: list[Chunk] = []
        while (self.events > self.max_events or self.bytes > self.max_bytes) and len(self._chunks) > 1:
            oldest = self.pop()
            dropped.append(oldest)
            split = oldest.split
            if split is not None:  # the rest of a split event is useless without this fragment
                while self._chunks and self._chunks[0].split is split:
                    dropped.append(self.pop())
        return dropped

    def peek(self) -> Chunk:
        return self._chunks[0]

    def pop(self) -> Chunk:
        chunk = self._chunks.popleft()
        self.events -= chunk.events
        self.bytes -= chunk.size
        return chunk

    def replace_head(self, chunks: Iterable[Chunk]) -> None:
        """Put ``chunks`` where the head chunk was (a re-split of it to a smaller budget)."""
        number = self.pop().number
        for chunk in reversed(list(chunks)):
            chunk.number = number
            self._chunks.appendleft(chunk)
            self.events += chunk.events
            self.bytes += chunk.size

    def take_all(self) -> list[Chunk]:
        """Remove and return every queued chunk."""
        chunks = list(self._chunks)
        self._chunks.clear()
        self.events = 0
        self.bytes = 0
        return chunks


def _add(target: dict[int, int], counts: Mapping[int, int]) -> None:
    for rank, n in counts.items():
        if n:
            target[rank] = target.get(rank, 0) + n


def _subtract(target: dict[int, int], counts: Mapping[int, int]) -> None:
    for rank, n in counts.items():
        left = target.get(rank, 0) - n
        if left:
            target[rank] = left
        else:
            target.pop(rank, None)


def _as_counts(drops: Iterable[RankDrops]) -> dict[int, int]:
    return {d.attention_dp_rank: d.dropped_events for d in drops}


class LossLedger:
    """Per-rank loss: pending (for the next batch), carried (by batches in flight) and reported
    (by delivered batches); see the module doc."""

    def __init__(self) -> None:
        self.pending: dict[int, int] = {}
        self.waiting: list[tuple[int, dict[int, int]]] = []
        """Parts of ``pending`` that only a chunk numbered at least so much may carry."""
        self.carried: dict[int, int] = {}
        self.reported: dict[int, int] = {}
        self.from_manager: dict[int, int] = {}
        self.lost: dict[str, dict[int, int]] = {reason: {} for reason in LOSS_REASONS}

    def manager_dropped(self, drops: Iterable[RankDrops], after: int | None = None) -> None:
        """Drops the manager reported in a drain; ``after``: the number of the first chunk that
        may carry them (the drain's own first chunk: the chunks before it hold older events)."""
        counts = {drop.attention_dp_rank: drop.dropped_events for drop in drops if drop.dropped_events}
        self._pend(counts, after)
        _add(self.from_manager, counts)

    def lose(self, counts: Mapping[int, int], reason: str, after: int | None = None) -> None:
        """The sink lost ``counts`` events per rank, for ``reason`` (one of :data:`LOSS_REASONS`);
        ``after`` as for :meth:`manager_dropped`."""
        self._pend(counts, after)
        _add(self.lost[reason], counts)

    def _pend(self, counts: Mapping[int, int], after: int | None) -> None:
        counts = {rank: n for rank, n in counts.items() if n}
        if not counts:
            return
        _add(self.pending, counts)
        if after is not None:
            self.waiting.append((after, counts))

    def reportable(self, chunk: int | None = None) -> list[RankDrops]:
        """What the batch of chunk number ``chunk`` may carry (sorted by rank; None: a batch
        with no events, made when no chunk waits: everything pending): each rank's pending count
        but what waits for a later chunk, at most what an Avro long holds (a forged engine seq
        can make a loss of 2**64; the rest waits for the batches after it)."""
        counts = dict(self.pending)
        if chunk is not None:
            for after, later in self.waiting:
                if after > chunk:
                    _subtract(counts, later)
        return [RankDrops(rank, min(n, MAX_REPORTED)) for rank, n in sorted(counts.items())]

    def take(self, chunk: int | None = None) -> list[RankDrops]:
        """:meth:`reportable`, for the batch being produced: moved from pending to carried."""
        carried = self.reportable(chunk)
        counts = _as_counts(carried)
        _subtract(self.pending, counts)
        _add(self.carried, counts)
        if self.waiting:  # what this batch could carry waits no more (past an Avro long: pending)
            self.waiting = [w for w in self.waiting if chunk is not None and w[0] > chunk]
        return carried

    def restore(self, carried: Iterable[RankDrops]) -> None:
        """The batch that carried these drops was not delivered (or not even produced): they are
        pending again."""
        counts = _as_counts(carried)
        _subtract(self.carried, counts)
        _add(self.pending, counts)

    def delivered(self, carried: Iterable[RankDrops]) -> None:
        """A batch that carried these drops was delivered: consumers know of them."""
        counts = _as_counts(carried)
        _subtract(self.carried, counts)
        _add(self.reported, counts)

    def unreported(self) -> dict[int, int]:
        """Losses per rank that no delivered batch reported yet (pending or carried in flight)."""
        total = dict(self.pending)
        _add(total, self.carried)
        return total

    def lost_by_rank(self) -> dict[int, int]:
        """Events the sink itself lost, per rank, all reasons together."""
        total: dict[int, int] = {}
        for counts in self.lost.values():
            _add(total, counts)
        return total

    def lost_by_reason(self) -> dict[str, int]:
        return {reason: sum(counts.values()) for reason, counts in self.lost.items()}
