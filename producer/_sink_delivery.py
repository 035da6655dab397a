"""The sink's way to Kafka: queued chunks handed to librdkafka (framed with their sequence and
the pending drops), delivery reports, librdkafka's errors and statistics, and the loss
accounting every failure goes through (``docs/OPERATIONS.md``, loss accounting)."""

from __future__ import annotations

import functools
import json
import logging
import time
from collections.abc import Mapping
from typing import Any

from confluent_kafka import KafkaError, KafkaException

from ._sink_base import BLOCKED, FULL_RETRY_S, POLL_S, PURGED, InFlight, call_safely
from ._sink_limit import TopicLimit
from .sink_chunks import EMPTY_EVENTS, Chunk, LostEvent
from .sink_stats import DeliveryReport

log = logging.getLogger("kvevents.producer.sink")  # the sink's one logger

CONTROL_HEADER = "kvevents-control"
"""Header of a sink's last batch (value ``close``): the instance stopped cleanly (the consumer's
liveness tracking drops its workers); carried in a header so the Avro envelope is unchanged.
Re-exported by :mod:`.sink`."""


class Delivery(TopicLimit):
    """Hand-off, produce, delivery reports and losses (part of ``KafkaEventSink``)."""

    def _poll_loop(self) -> None:
        while self._polling:
            try:
                self._producer.poll(POLL_S)
            except Exception:
                log.exception("Kafka sink: a librdkafka callback failed")

    def _lose_event_locked(self, lost: LostEvent) -> None:
        self._lose_locked({lost.rank: 1}, lost.reason, {lost.rank: lost.event_id})
        self._ratelimited(
            logging.ERROR, lost.reason, "Dropped KV-cache event %d of rank %d (%s): %s",
            lost.event_id, lost.rank, lost.reason, lost.detail,
        )  # fmt: skip

    def _lose_chunk_locked(self, chunk: Chunk, reason: str) -> None:
        """Count a lost chunk. Every chunk queued after it holds newer events, so the next one
        (the queue's head, for ``queue_full`` and failed deliveries) may carry the loss; a
        fragment's loss waits for a chunk queued after now (its event's later fragments may
        still be queued)."""
        counts = dict(chunk.by_rank)
        split = chunk.split
        if split is not None and split.lose():
            counts[split.rank] = counts.get(split.rank, 0) + 1
        after = chunk.number + 1 if split is None and chunk.number >= 0 else None
        self._lose_locked(counts, reason, chunk.last_event_ids, after=after)

    def _lose_locked(
        self,
        counts: dict[int, int],
        reason: str,
        newest_event_ids: Mapping[int, int] | None = None,
        *,
        after: int | None = None,
    ) -> None:
        """Count a loss (in-band in the next batch that may carry it) and tell the manager, whose
        rank must then publish a snapshot (not for events still unsent at close: the engine has
        stopped). ``after``: the first chunk number that may carry it; by default a chunk queued
        after now (or a batch with no events): a chunk queued before may hold events older than
        the lost ones."""
        self._ledger.lose(counts, reason, after=self._queue.pushed if after is None else after)
        report = self._report_lost
        if report is None or reason == "unsent_at_close":
            return
        for rank, count in counts.items():
            newest = None if newest_event_ids is None else newest_event_ids.get(rank)
            try:
                report(rank, count, newest, where=f"lost by the Kafka sink ({reason})")
            except Exception:  # a listener's bug must not stop the sink's accounting
                log.exception("report_lost_events failed")

    def _hand_off(self) -> bool:
        """Hand queued chunks, then any pending drops, to librdkafka; True when something must
        wait (librdkafka's queue is full, the message limit is not known yet, or an idempotent
        producer already has ``IDEMPOTENT_WINDOW`` messages unacknowledged; not when stopping)."""
        if not self._limit_known:
            return bool(self._queue) or bool(self._ledger.pending)
        with self._lock:
            queue = self._queue
            if self._full_since is not None:
                # librdkafka refused the last message for lack of room: try again only when a
                # delivery report freed some, or after a while (no message framed in vain)
                if self._deliveries == self._full_at and time.monotonic() - self._full_since < FULL_RETRY_S:
                    return bool(queue) or bool(self._ledger.pending)
                self._full_since = None
            budget = self._current_budget()
            window = None if self._stop_requested else self._hand_off_window
            if queue and window is not None and self._in_flight >= window:
                return True  # librdkafka would only hold them (IDEMPOTENT_WINDOW): an ack wakes us
            while queue:
                chunk = queue.peek()
                if chunk.size > budget:
                    self._resplit_head_locked(chunk, budget)
                    continue
                if self._produce_locked(chunk) is BLOCKED:
                    return True
                queue.pop()
            if self._ledger.pending and self._in_flight == 0:
                empty = Chunk(EMPTY_EVENTS, 0, {}, {})
                return self._produce_locked(empty) is BLOCKED
            if (
                self._heartbeat_s is not None
                and not self._stop_requested
                and time.monotonic() - self._last_produced >= self._heartbeat_s
            ):
                # idle: a batch with no events tells consumers this instance is alive
                if self._produce_locked(Chunk(EMPTY_EVENTS, 0, {}, {})) is BLOCKED:
                    return True
                self._heartbeats += 1
        return False

    def _say_closing(self) -> None:
        """The last batch: no events, header ``kvevents-control: close`` (a clean stop)."""
        with self._lock:
            if self._fatal is None:
                self._produce_locked(Chunk(EMPTY_EVENTS, 0, {}, {}), closing=True)

    def _resplit_head_locked(self, chunk: Chunk, budget: int) -> None:
        """Cut the head chunk again: it was made before the topic's smaller limit was known."""
        speculative, self._writer.speculative = self._writer.speculative, None  # it takes the lock
        try:
            self._resplit_head(chunk, budget)
        finally:
            self._writer.speculative = speculative

    def _resplit_head(self, chunk: Chunk, budget: int) -> None:
        whole = (
            self._writer.template_prefix() + chunk.part if chunk.envelope is None else chunk.encoded_message()
        )
        events = self._codec.decode_batch(whole).events
        replacement: list[Chunk] = []
        for item in self._chunker.chunks(events, budget):
            if isinstance(item, LostEvent):
                if chunk.split is not None:
                    self._lose_chunk_locked(Chunk(EMPTY_EVENTS, 0, {}, {}, split=chunk.split), item.reason)
                else:
                    self._lose_event_locked(item)
                continue
            if chunk.split is not None:  # a fragment cut into smaller fragments of the same event
                item.first_event_block_offset += chunk.first_event_block_offset
                item.split = chunk.split
            elif item.split is not None and item.first_event_block_offset == 0:
                self._split_events += 1
                self._fragments += item.split.fragments
            replacement.append(item)
        if chunk.split is not None and replacement:
            chunk.split.fragments += len(replacement) - 1
            self._fragments += len(replacement) - 1
        self._queue.replace_head(replacement)

    def _produce_locked(self, chunk: Chunk, *, closing: bool = False) -> object:
        carried = self._ledger.take(chunk.number if chunk.number >= 0 else None)
        sequence = self._next_sequence
        guess = chunk.envelope
        try:
            if (
                guess is not None
                and guess.sequence == sequence
                and guess.dropped == carried
                and guess.first_event_block_offset == chunk.first_event_block_offset
            ):
                value = chunk.encoded_message()  # encoded with this very envelope: as it is
            else:
                value = self._writer.message(
                    chunk.part,
                    producer_id=self._producer_id,
                    sequence=sequence,
                    created_at_us=time.time_ns() // 1000,
                    dropped=carried,
                    first_event_block_offset=chunk.first_event_block_offset,
                )
        except Exception:
            self._ledger.restore(carried)
            log.exception("Could not frame a message of %d events; counted as lost", chunk.events)
            self._lose_chunk_locked(chunk, "unencodable")
            return None
        record = InFlight(chunk, sequence, carried, len(value), time.monotonic())
        try:
            self._producer.produce(
                self._topic,
                value,
                self._key,
                headers=[*self._headers, (CONTROL_HEADER, b"close")] if closing else self._headers,  # type: ignore[arg-type]  # list is invariant in the stub
                on_delivery=functools.partial(self._delivered, record),
            )
        except BufferError:
            self._ledger.restore(carried)
            self._full_since = time.monotonic()
            self._full_at = self._deliveries
            return BLOCKED
        except KafkaException as exc:
            self._ledger.restore(carried)
            error = exc.args[0] if exc.args else exc
            name = error.name() if isinstance(error, KafkaError) else type(exc).__name__
            self._failed_by_error[name] = self._failed_by_error.get(name, 0) + 1
            self._lose_chunk_locked(chunk, "produce_failed")
            self._ratelimited(
                logging.ERROR, f"produce:{name}",
                "librdkafka refused a message of %d bytes (%d events): %s; counted as lost",
                len(value), chunk.events, error,
            )  # fmt: skip
            return None
        self._next_sequence = sequence + 1
        self._last_produced = time.monotonic()
        self._in_flight += 1
        self._in_flight_events += chunk.events
        return None

    # -- librdkafka callbacks (delivery thread, or close) -----------------------------------

    def _delivered(self, record: InFlight, err: KafkaError | None, msg: Any) -> None:
        latency = msg.latency() if msg is not None else None
        latency = float(latency) if latency is not None else time.monotonic() - record.produced_at
        chunk = record.chunk
        with self._room:
            self._deliveries += 1
            self._in_flight -= 1
            self._in_flight_events -= chunk.events
            if err is None:
                self._delivered_messages += 1
                self._delivered_bytes += record.size
                by_rank = self._delivered_by_rank
                for rank, n in chunk.by_rank.items():
                    by_rank[rank] = by_rank.get(rank, 0) + n
                delivered = chunk.events if chunk.split is None else 0
                if chunk.split is not None and chunk.split.deliver():
                    delivered = 1
                    by_rank[chunk.split.rank] = by_rank.get(chunk.split.rank, 0) + 1
                self._delivered_events += delivered
                self._ledger.delivered(record.carried)
                self._latency.observe(latency)
            else:
                self._failed_messages += 1
                name = err.name()
                self._failed_by_error[name] = self._failed_by_error.get(name, 0) + 1
                self._ledger.restore(record.carried)
                purged = err.code() in PURGED
                self._lose_chunk_locked(chunk, "unsent_at_close" if purged else "delivery_failed")
                if not purged:
                    self._ratelimited(
                        logging.ERROR, f"delivery:{name}",
                        "Kafka did not take batch %d (%d events): %s; counted as lost and reported in-band",
                        record.sequence, chunk.events, err,
                    )  # fmt: skip
            self._room.notify_all()
        if self._on_delivery_report is not None:
            report = DeliveryReport(
                sequence=record.sequence,
                events=chunk.events,
                events_by_rank=dict(chunk.by_rank) if chunk.split is None else {chunk.split.rank: 1},
                last_event_id_by_rank=dict(chunk.last_event_ids),
                dropped={d.attention_dp_rank: d.dropped_events for d in record.carried},
                size_bytes=record.size,
                first_event_block_offset=chunk.first_event_block_offset,
                produced_at=record.produced_at,
                latency_s=latency,
                acked_at=record.produced_at + latency,
                error=err,
                partition=msg.partition() if msg is not None and err is None else None,
                offset=msg.offset() if msg is not None and err is None else None,
            )
            call_safely(self._on_delivery_report, report)
        if self._user_on_delivery is not None:
            call_safely(self._user_on_delivery, err, msg)

    def _on_error(self, err: KafkaError) -> None:
        name = err.name()
        with self._lock:
            self._errors_by_code[name] = self._errors_by_code.get(name, 0) + 1
            if err.fatal():
                self._fatal = str(err)
        if err.fatal():
            log.error("Kafka producer fatal error: %s; every further batch will fail (counted)", err)
        else:
            self._ratelimited(logging.WARNING, f"error:{name}", "Kafka producer: %s", err)
        if self._user_error_cb is not None:
            call_safely(self._user_error_cb, err)

    def _on_stats(self, stats_json: str) -> None:
        try:
            stats = json.loads(stats_json)
        except ValueError:
            stats = {}
        kept = {key: stats[key] for key in _LIBRDKAFKA_STATS if key in stats}
        brokers = stats.get("brokers") or {}
        rtts = [b.get("rtt", {}).get("p99", 0) for b in brokers.values() if isinstance(b, dict)]
        if rtts:
            kept["broker_rtt_p99_us"] = max(rtts)
        with self._lock:
            self._librdkafka_stats = kept
        if self._user_stats_cb is not None:
            call_safely(self._user_stats_cb, stats_json)


_LIBRDKAFKA_STATS = (
    "msg_cnt",
    "msg_size",
    "msg_max",
    "msg_size_max",
    "txmsgs",
    "txmsg_bytes",
    "tx",
    "txbytes",
)
"""Top-level librdkafka statistics the sink keeps (messages/bytes queued, sent)."""
