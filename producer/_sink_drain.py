"""The sink thread: drains the manager (events as objects, or as Avro bytes from a source that
has them so), cuts them into chunks, queues them and hands them off; the envelope a chunk is
encoded with when it can be produced at once."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

from kvevents.schemas import EventBatch, KVCacheEvent

from ._sink_base import IDLE_WAIT_S, STUCK_WAIT_S
from ._sink_delivery import Delivery
from .buffer import EventDrain
from .sink_chunks import LostEvent
from .sink_encoded import EncodedDrain, EncodedEvents

log = logging.getLogger("kvevents.producer.sink")  # the sink's one logger

MAX_FOLLOWING_DRAINS = 1024
"""The most drains one loop pass takes after a drain cut short (the next pass takes the rest)."""


class Drain(Delivery):
    """The sink thread's loop (part of ``KafkaEventSink``)."""

    def _run(self) -> None:
        try:
            self._loop()
        except Exception:
            log.exception("The Kafka sink thread failed; queued events are counted as lost")
            with self._lock:
                for chunk in self._queue.take_all():
                    self._lose_chunk_locked(chunk, "unsent_at_close")

    def _loop(self) -> None:
        manager = self._manager
        while True:
            self._iterations += 1
            stopping = self._stop_requested
            if stopping:
                self._accept_all(self._drain(0))
            self._resolve_topic_limit()
            stuck = self._hand_off()
            if stopping and (not stuck or time.monotonic() >= self._stop_deadline):
                if not stuck:
                    self._say_closing()
                return
            if stuck or stopping or manager.closed:
                with self._room:
                    if self._stop_requested == stopping and not self._window_reopened_locked():
                        self._room.wait(STUCK_WAIT_S if stuck else IDLE_WAIT_S)
                if not stopping:
                    self._accept_all(self._drain(0))
            else:
                self._accept_all(self._drain(IDLE_WAIT_S))

    def _window_reopened_locked(self) -> bool:
        """Chunks held for the hand-off window whose acknowledgements came before the wait (its
        notification already gone): hand them off without waiting."""
        window = self._hand_off_window
        return (
            window is not None
            and self._limit_known
            and self._full_since is None
            and bool(self._queue)
            and self._in_flight < window
        )

    def _accept_all(self, drain: EventDrain | EncodedDrain) -> None:
        """Accept ``drain`` and, while it stopped before drops recorded behind its events
        (``more``), the drains that follow it: one loop pass takes everything buffered at its
        start, as ``wait_delivered`` expects."""
        for _ in range(MAX_FOLLOWING_DRAINS):
            self._accept(drain)
            if not getattr(drain, "more", False):
                return
            drain = self._drain(0)
        self._accept(drain)

    def _accept(self, drain: EventDrain | EncodedDrain) -> None:
        """Count the drain's drops, cut its events into chunks and queue them (handing them off
        as they come, so encoding overlaps librdkafka's compression and sending)."""
        if drain.dropped:
            with self._lock:
                self._ledger.manager_dropped(drain.dropped, after=self._queue.pushed)
        events = drain.events
        if not events:
            return
        accounted = 0
        chunker = self._encoded_chunker if isinstance(events, EncodedEvents) else self._chunker
        try:
            with self._lock:
                self._drained += len(events)
                budget = self._current_budget()
            for item in chunker.chunks(events, budget):
                with self._lock:
                    if isinstance(item, LostEvent):
                        accounted += 1
                        self._lose_event_locked(item)
                    else:
                        if item.split is None:
                            accounted += item.events
                        elif item.first_event_block_offset == 0:
                            accounted += 1
                            self._split_events += 1
                            self._fragments += item.split.fragments
                        for dropped in self._queue.push(item):
                            self._lose_chunk_locked(dropped, "queue_full")
                if self._limit_known:
                    self._hand_off()
        except Exception:
            rest = events[accounted:]
            log.exception("Could not encode %d KV-cache events; counted as lost", len(rest))
            with self._lock:
                self._lose_locked(count_by_rank(rest), "unencodable")

    def _speculate(self, first_event_block_offset: int) -> EventBatch | None:
        """The envelope the next message gets if it is produced at once: only when nothing waits
        in the queue (else it is framed at hand-off)."""
        with self._lock:
            if not self._limit_known or self._queue or self._full_since is not None:
                return None
            dropped = self._ledger.reportable(self._queue.pushed)
            sequence = self._next_sequence
        return EventBatch(
            self._instance_id,
            [],
            attention_dp_size=self._dp_size,
            producer_id=self._producer_id,
            sequence=sequence,
            created_at_us=time.time_ns() // 1000,
            dropped=dropped,
            first_event_block_offset=first_event_block_offset,
        )


def count_by_rank(events: Sequence[KVCacheEvent]) -> dict[int, int]:
    if isinstance(events, EncodedEvents):
        return events.count_by_rank()
    counts: dict[int, int] = {}
    for event in events:
        rank = 0 if event.attention_dp_rank is None else event.attention_dp_rank
        counts[rank] = counts.get(rank, 0) + 1
    return counts
