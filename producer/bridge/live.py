"""``ZmqBridge``: a running vLLM/SGLang engine's ZMQ events as an ``EventSource`` for
``KafkaEventSink``.

Threads: the socket thread (:mod:`.receiver`) only receives; this module's worker thread orders
each rank's messages by seq, asks for replay (:mod:`.replay`), converts (:class:`ZmqEventConverter`)
and hands events to the sink's thread through :meth:`drain`. Per rank:

- seq + 1: converted; a gap: replayed from the engine, and what replay cannot give is reported
  in-band as lost (``EventDrain.dropped``, counted in engine batches) so the index marks the
  worker degraded; the first message with seq > 0 and no saved state is a gap from 0 (joining
  mid-stream is a loss unless replay fills it); a gap costs the seqs received, not its width (a
  forged seq may jump to 2**64 - 1; the sink reports such a loss over as many batches as it takes);
- seq going backwards: the engine restarted, its cache is empty: a Created event first;
- a payload that cannot be read: counted, kept (the last 20), and reported as lost.

State (``state_path``): see :mod:`.state`. ``preencoded`` (the default when the compiled converter
is built): events are handed to the sink as Avro bytes (``drain_encoded``), no object per event.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from kvevents.schemas import KVCacheEvent, KVCacheStoredData, RankDrops

from kvevents._brief import brief

from ..buffer import EventDrain
from ..sink_chunks import DATA_ERRORS
from ..sink_encoded import EncodedDrain, EncodedEvents
from ..sink_stats import DeliveryReport
from . import convert as _convert
from .convert import ZmqEventConverter
from .receiver import ZmqReceiver, rank_endpoint
from .replay import ReplayResult, request_replay
from .state import AckFile, load_state, save_state
from .wire import BridgeDecodeError

__all__ = ["ZmqBridge"]

log = logging.getLogger(__name__)

_REPLAYED_KEPT = 20_000
_COUNTS = (
    "batches",
    "events",
    "gaps",
    "replays",
    "replayed_batches",
    "replays_incomplete",
    "replays_with_holes",
    "batches_lost",
    "bad_payloads",
    "engine_restarts",
    "events_already_in_kafka",
    "checkpoints",
    "checkpoints_deferred",
)


class ZmqBridge:
    """Subscribes to ``dp_size`` engine publishers (``endpoint`` port + rank) and converts their
    batches; pass it to ``KafkaEventSink`` as the manager and ``on_delivery=bridge.on_delivery``.

    ``in_kafka``: per rank the last event id the topic already holds for this instance
    (:func:`.kafka_tail.last_events`); events regenerated from replay up to it are skipped.
    ``in_kafka_blocks``: per rank, when that last event is a Stored one, how many of its blocks
    the topic holds: if its regenerated event has more, the sink was killed between the
    fragments of a split event, and the missing tail is reported in-band as lost (a new
    producer session cannot continue a split event). Call :meth:`watch` with the sink so that
    checkpoints are taken only when it has nothing queued or in flight (no event half sent).
    ``preencoded``: hand events over as Avro bytes (:meth:`drain_encoded`); None: when the
    compiled converter is built. The topic gets the same bytes either way.
    """

    def __init__(
        self,
        engine: str,
        endpoint: str,
        *,
        dp_size: int = 1,
        replay_endpoint: str | None = None,
        topic: bytes = b"",
        window_size: int = 0,
        state_path: Path | None = None,
        max_queued: int = 100_000,
        rcvhwm: int = 100_000,
        max_pending_events: int = 200_000,
        replay_timeout: float = 2.0,
        checkpoint_interval: float = 2.0,
        idle_probe: float = 1.0,
        in_kafka: dict[int, int] | None = None,
        in_kafka_blocks: dict[int, int] | None = None,
        ctx: Any = None,
        preencoded: bool | None = None,
    ) -> None:
        import zmq

        if dp_size < 1:
            raise ValueError(f"dp_size must be >= 1, got {dp_size}")
        self.engine = engine
        self._dp_size = dp_size
        self._replay_endpoint = replay_endpoint
        self._replay_timeout = replay_timeout
        self._ctx = ctx if ctx is not None else zmq.Context()
        self._own_ctx = ctx is None
        self._state_path = state_path
        self._interval = checkpoint_interval
        self._idle_probe = idle_probe
        self._max_pending = max_pending_events

        self.converters = {
            r: ZmqEventConverter(engine, window_size=window_size, dp_rank=r) for r in range(dp_size)
        }
        self.last_seq: dict[int, int | None] = dict.fromkeys(range(dp_size))
        self._skip_through: dict[int, int] = {}
        self._replayed: dict[int, dict[int, int]] = {r: {} for r in range(dp_size)}  # seq -> hash(payload)
        self._acks: AckFile | None = None
        self._tail_blocks: dict[int, int] = {}  # rank -> blocks of its last (Stored) event in Kafka
        self._sink_idle: Callable[[], bool] | None = None
        if state_path is not None:
            saved = load_state(state_path, engine)
            self._acks = AckFile(state_path.with_name(state_path.name + ".acked"))
            if saved is not None:
                for rank, entry in saved.items():
                    if rank < dp_size:
                        self.converters[rank], self.last_seq[rank] = _restored_rank(state_path, rank, entry)
                self._skip_through = dict(self._acks.acked)
                for rank, event_id in (in_kafka or {}).items():
                    # what the topic holds (read back by the caller) wins over the acknowledgement file
                    self._skip_through[rank] = max(event_id, self._skip_through.get(rank, -1))
                    held = (in_kafka_blocks or {}).get(rank)
                    if held is not None and self._skip_through[rank] == event_id:
                        self._tail_blocks[rank] = held
                log.info(
                    "bridge state loaded from %s: last seqs %s, ids in Kafka %s",
                    state_path,
                    self.last_seq,
                    self._skip_through,
                )

        self._lock = threading.Condition()
        self.preencoded = _convert.compiled_encode is not None if preencoded is None else preencoded
        self._pending: list[KVCacheEvent] = []  # not preencoded
        self._encoded = EncodedEvents()  # preencoded
        self._scratch = EncodedEvents()
        self._dropped: Counter[int] = Counter()
        self._resolved: dict[int, int] = {}  # rank -> last event id Kafka answered for
        self._losses_unacked = 0
        self._closing = False
        self._done = False
        self.counts: Counter[str] = Counter()
        self.bad_payloads: deque[tuple[int, int, str, bytes]] = deque(maxlen=20)
        self.receiver = ZmqReceiver(
            self._ctx, endpoint, dp_size, topic=topic, max_queued=max_queued, rcvhwm=rcvhwm
        )
        self._thread = threading.Thread(target=self._run, name="kvevents-bridge", daemon=True)
        self._thread.start()

    # -- EventSource --------------------------------------------------------------------

    @property
    def attention_dp_size(self) -> int:
        return self._dp_size

    @property
    def closed(self) -> bool:
        with self._lock:
            return self._done and not self._queued() and not self._dropped

    def drain(self, timeout: float | None = None) -> EventDrain:
        events, dropped = self._take(timeout)
        return EventDrain(events.decode() if isinstance(events, EncodedEvents) else events, dropped)

    def drain_encoded(self, timeout: float | None = None) -> EncodedDrain:
        """:meth:`drain`, the events as Avro bytes when ``preencoded`` (the sink's input)."""
        return EncodedDrain(*self._take(timeout))

    def _take(self, timeout: float | None) -> tuple[EncodedEvents | list[KVCacheEvent], list[RankDrops]]:
        with self._lock:
            if not self._queued() and not self._dropped and not self._done:
                self._lock.wait(timeout)
            events: EncodedEvents | list[KVCacheEvent]
            if self.preencoded:
                events, self._encoded = self._encoded, EncodedEvents()
            else:
                events, self._pending = self._pending, []
            dropped = [RankDrops(r, n) for r, n in sorted(self._dropped.items()) if n > 0]
            self._losses_unacked += sum(self._dropped.values())
            self._dropped.clear()
            self._lock.notify_all()
        return events, dropped

    def _queued(self) -> int:
        return len(self._pending) + len(self._encoded)

    def on_delivery(self, report: DeliveryReport) -> None:
        """The sink's delivery callback: what Kafka acknowledged (for checkpoints and restarts)."""
        with self._lock:
            for rank, event_id in report.last_event_id_by_rank.items():
                if event_id > self._resolved.get(rank, -1):
                    self._resolved[rank] = event_id
            if report.error is None and report.dropped:
                self._losses_unacked = max(0, self._losses_unacked - sum(report.dropped.values()))
            self._lock.notify_all()
        if report.error is None and self._acks is not None:
            try:
                self._acks.update(report.last_event_id_by_rank)
            except OSError as exc:
                log.error("cannot write %s: %s", self._acks.path, exc)

    # -- public -------------------------------------------------------------------------

    def watch(self, sink: Any) -> None:
        """Take checkpoints only when ``sink`` (the ``KafkaEventSink`` draining this bridge) has
        nothing queued or in flight: every fragment of a split event is then acknowledged."""

        def idle() -> bool:
            stats = sink.stats()
            return bool(stats.queued_messages == 0 and stats.in_flight_messages == 0)

        self._sink_idle = idle

    def stats(self) -> dict[str, Any]:
        with self._lock:
            out: dict[str, Any] = {key: self.counts.get(key, 0) for key in _COUNTS}
            out.update(self.counts)
            out["pending_events"] = self._queued()
        out["received_by_rank"] = dict(self.receiver.received)
        out["queue_dropped_by_rank"] = dict(self.receiver.dropped)
        out["malformed_frames_by_rank"] = dict(self.receiver.malformed)
        out["last_seq"] = dict(self.last_seq)
        out["converters"] = {r: c.stats() for r, c in self.converters.items()}
        return out

    def close(self, timeout: float = 10.0) -> None:
        """Stop receiving, convert what was received, and save a last checkpoint once the sink
        acknowledged it (call before closing the sink, with the sink still running)."""
        self.receiver.close()
        with self._lock:
            self._closing = True
            self._lock.notify_all()
        self._thread.join(timeout)
        if self._own_ctx:
            self._ctx.term()

    # -- worker -------------------------------------------------------------------------

    def _run(self) -> None:
        q = self.receiver.queue
        next_checkpoint = time.monotonic() + self._interval
        next_probe = time.monotonic()  # at once: a restarted bridge catches up before any live message
        probe_wait = self._idle_probe
        try:
            while True:
                tail_drops = dict(self.receiver.max_dropped_seq)
                try:
                    rank, seq, payload, _ = q.get(timeout=0.05)
                except queue.Empty:
                    self._fill_tail(tail_drops)
                    if (
                        self._replay_endpoint is not None
                        and time.monotonic() >= next_probe
                        and not self._closing
                    ):
                        answered = [self._catch_up(r) for r in range(self._dp_size)]
                        # an engine whose replay does not answer is asked less often (up to 30 s)
                        probe_wait = self._idle_probe if all(answered) else min(probe_wait * 2, 30.0)
                        next_probe = time.monotonic() + probe_wait
                    if self._closing:
                        break
                else:
                    self._on_message(rank, seq, payload)
                    next_probe = time.monotonic() + self._idle_probe
                if self._state_path is not None and time.monotonic() >= next_checkpoint:
                    self._checkpoint(wait=0.5)
                    next_checkpoint = time.monotonic() + self._interval
            if self._state_path is not None:
                self._checkpoint(wait=5.0)
        except Exception:
            log.exception("bridge worker stopped")
            self.counts["worker_errors"] += 1
        finally:
            with self._lock:
                self._done = True
                self._lock.notify_all()

    def _on_message(self, rank: int, seq: int, payload: bytes) -> None:
        last = self.last_seq[rank]
        if last is not None and seq <= last:
            if self._replayed[rank].get(seq) == hash(payload):
                self.counts["live_duplicates_of_replay"] += 1  # received live while replay gave it
                return
            log.warning(
                "rank %d: seq went back from %d to %d: the engine restarted (Created)", rank, last, seq
            )
            self.counts["engine_restarts"] += 1
            self._bump_past_acked(rank)
            self._emit(rank, [self.converters[rank].created(rank)])
            self.last_seq[rank] = last = None
            self._replayed[rank].clear()
        expected = 0 if last is None else last + 1
        if seq > expected:
            self._fill(rank, expected, seq)
        self._apply(rank, seq, payload)

    def _fill_tail(self, tail_drops: dict[int, int]) -> None:
        """The queue is empty, so every message received before these drops was handled: a
        dropped seq beyond the last one applied is a gap no later message has revealed yet."""
        for rank, dropped_seq in tail_drops.items():
            if self.receiver.max_dropped_seq.get(rank) == dropped_seq:
                del self.receiver.max_dropped_seq[rank]
            last = self.last_seq[rank]
            expected = 0 if last is None else last + 1
            if dropped_seq >= expected:
                self._fill(rank, expected, dropped_seq + 1)

    def _catch_up(self, rank: int) -> bool:
        """Idle (or just started): ask the engine for anything after the last seq applied, so that
        batches no live message will reveal (a tail dropped at the PUB's high-water mark, or sent
        while the bridge was down) are not missed."""
        assert self._replay_endpoint is not None
        last = self.last_seq[rank]
        start = 0 if last is None else last + 1
        result = request_replay(
            self._ctx, rank_endpoint(self._replay_endpoint, rank), start, timeout=self._replay_timeout
        )
        self.counts["replay_probes"] += 1
        newer = [s for s, _ in result.batches if s >= start]
        if newer:
            self._fill(rank, start, max(newer) + 1, result)
        if not result.complete:
            self.counts["replay_probes_unanswered"] += 1
        return result.complete

    def _fill(self, rank: int, start: int, end: int, result: ReplayResult | None = None) -> None:
        """Batches ``start..end-1`` were not received: replay them, report what is still missing."""
        self.counts["gaps"] += 1
        got: dict[int, bytes] = {}
        if result is not None or self._replay_endpoint is not None:
            got = self._replay_range(rank, start, end, result)
        missing_from = start  # the seqs got are walked, not the gap: a forged seq can be 2**64 - 1
        for s in sorted(seq for seq in got if start <= seq < end):
            if s > missing_from:
                self._lose(rank, s - missing_from, f"seqs {missing_from}..{s - 1}")
            self._apply(rank, s, got[s])
            replayed = self._replayed[rank]
            replayed[s] = hash(got[s])
            if len(replayed) > _REPLAYED_KEPT:
                del replayed[next(iter(replayed))]
            missing_from = s + 1
        if end > missing_from:
            self._lose(rank, end - missing_from, f"seqs {missing_from}..{end - 1}")

    def _replay_range(self, rank: int, start: int, end: int, result: ReplayResult | None) -> dict[int, bytes]:
        """Seqs ``start..end-1`` from the engine's replay (``result``: an answer from ``start``
        already had).

        An engine answers a request from one look at its buffer: every seq it holds from the one
        asked on, in order, and it forgets only its oldest. So within an answer, a seq missing
        after the first one received was not forgotten but dropped on the way: a ROUTER socket
        drops, silently, what goes beyond its high-water mark (vLLM's replay ROUTER keeps the
        default, 1000 messages) when its I/O thread or this reader falls behind (a loaded
        machine, a gap of thousands of batches), and the end marker can still come. Such a seq
        is asked for again, from the first one missing, as long as each answer brings seqs not
        had yet; what is still missing then (forgotten, or the engine stopped answering) is lost.
        """
        got: dict[int, bytes] = {}
        ask = start
        while True:
            if result is None:
                assert self._replay_endpoint is not None
                result = request_replay(
                    self._ctx, rank_endpoint(self._replay_endpoint, rank), ask, timeout=self._replay_timeout
                )
            new = {s: p for s, p in result.batches if ask <= s < end and s not in got}
            got.update(new)
            self.counts["replays"] += 1
            self.counts["replayed_batches"] += len(new)
            if not result.complete:
                self.counts["replays_incomplete"] += 1
            if not new:
                return got
            ask = next((s for s in range(min(got), end) if s not in got), end)
            if ask == end:
                return got
            self.counts["replays_with_holes"] += 1
            log.info("rank %d: replay answer lacks seq %d (dropped on the way): asking again", rank, ask)
            result = None

    def _lose(self, rank: int, batches: int, what: str) -> None:
        log.warning(
            "rank %d: %d engine batches lost (%s): reported in-band, the worker is degraded",
            rank,
            batches,
            what,
        )
        self.counts["batches_lost"] += batches
        self._bump_past_acked(rank)
        with self._lock:
            self._dropped[rank] += batches
            self._lock.notify_all()

    def _bump_past_acked(self, rank: int) -> None:
        """After a restart of the bridge, events not regenerated from replay take ids past what
        Kafka already has, so the new session continues without reusing an id."""
        acked = self._skip_through.get(rank)
        if acked is not None:
            conv = self.converters[rank]
            conv.next_event_id[rank] = max(conv.next_event_id.get(rank, 0), acked + 1)

    def _apply(self, rank: int, seq: int, payload: bytes) -> None:
        self.last_seq[rank] = seq
        self.counts["batches"] += 1
        conv = self.converters[rank]
        skip = self._skip_through.get(rank)
        events: Sequence[KVCacheEvent]
        try:
            if self.preencoded and skip is None and self._convert_into_pending(conv, payload):
                return
            self._scratch.clear()
            if self.preencoded and conv.convert_encoded(payload, self._scratch):
                events = self._scratch
            else:
                events = conv.convert(payload)
        except BridgeDecodeError as exc:
            self.counts["bad_payloads"] += 1
            self.bad_payloads.append((rank, seq, str(exc), bytes(payload[:4096])))
            self._lose(rank, 1, f"seq {seq} unreadable: {exc}")
            return
        if skip is not None:
            if rank in self._tail_blocks:
                self._check_tail(rank, skip, events)
            first = 0  # ids increase: what Kafka has is a prefix
            while first < len(events) and _event_id(events, first) <= skip:
                first += 1
            self.counts["events_already_in_kafka"] += first
            events = events[first:]
        if events:
            self._emit(rank, events)

    def _convert_into_pending(self, conv: ZmqEventConverter, payload: bytes) -> bool:
        """The common case: the compiled converter appends to what the sink drains next (no
        copy); False (nothing changed) when it does not take the payload."""
        with self._lock:
            while self._queued() >= self._max_pending and not self._closing:
                self._lock.wait(0.1)  # the sink is behind: the receiver's queue absorbs this
            ends = self._encoded.ends  # a whole EncodedEvents: as many ends as events
            before = len(ends)
            if not conv.convert_encoded(payload, self._encoded):
                return False
            self.counts["events"] += len(ends) - before
            if before == 0:  # a drain waits only when nothing was pending
                self._lock.notify_all()
        return True

    def _check_tail(self, rank: int, last_in_kafka: int, events: Sequence[KVCacheEvent]) -> None:
        """The topic's last event of ``rank`` regenerated: lost blocks if Kafka holds fewer."""
        for k in range(len(events)):
            if _event_id(events, k) != last_in_kafka:
                continue
            event = events[k]  # decoded if pre-encoded
            held = self._tail_blocks.pop(rank)
            data = event.data
            if isinstance(data, KVCacheStoredData) and len(data.blocks) > held:
                self.counts["split_tails_lost"] += 1
                self._lose(
                    rank,
                    1,
                    f"event {event.event_id}: Kafka holds {held} of its {len(data.blocks)} blocks "
                    "(the bridge stopped between the fragments of a split event)",
                )
            return

    def _emit(self, rank: int, events: Sequence[KVCacheEvent]) -> None:
        if self.preencoded and not isinstance(events, EncodedEvents):
            events = self._encode(rank, events)
        with self._lock:
            while self._queued() >= self._max_pending and not self._closing:
                self._lock.wait(0.1)  # the sink is behind: the receiver's queue absorbs this
            if isinstance(events, EncodedEvents):
                self._encoded.extend(events)
            else:
                self._pending.extend(events)
            self.counts["events"] += len(events)
            self._lock.notify_all()

    def _encode(self, rank: int, events: Sequence[KVCacheEvent]) -> EncodedEvents:
        """Events of the Python paths as Avro bytes; one the schema cannot carry is lost (counted
        and reported in-band, as the sink would for an object it cannot encode)."""
        out = EncodedEvents()
        for event in events:
            try:
                out.add([event])
            except DATA_ERRORS as exc:
                log.error("rank %d: event %d cannot be encoded, dropped: %s", rank, event.event_id, exc)
                self.counts["unencodable_events"] += 1
                with self._lock:
                    self._dropped[rank] += 1
                    self._lock.notify_all()
        return out

    def _checkpoint(self, wait: float) -> bool:
        """Save the state if Kafka answered for every event made so far (waits up to ``wait``)."""
        assert self._state_path is not None
        targets = {r: c.next_event_id.get(r, 0) - 1 for r, c in self.converters.items()}
        deadline = time.monotonic() + wait
        while True:
            with self._lock:
                settled = (
                    not self._queued()
                    and not self._dropped
                    and self._losses_unacked == 0
                    and all(
                        self._resolved.get(r, -1) >= t or self._skip_through.get(r, -1) >= t
                        for r, t in targets.items()
                        if t >= 0
                    )
                )
            # Nothing pending and this thread the only one adding: the sink idle from now on
            # means all was sent. Asked outside the bridge's lock (the sink takes its own).
            if settled and self._sink_idle is not None:
                settled = self._sink_idle()
            remaining = deadline - time.monotonic()
            if settled or remaining <= 0:
                break
            with self._lock:
                self._lock.wait(min(remaining, 0.05))
        if not settled:
            self.counts["checkpoints_deferred"] += 1
            return False
        ranks = {
            r: {"last_seq": self.last_seq[r], "converter": c.to_state()} for r, c in self.converters.items()
        }
        try:
            save_state(self._state_path, self.engine, ranks)
        except OSError as exc:
            log.error("cannot save bridge state to %s: %s", self._state_path, exc)
            return False
        self.counts["checkpoints"] += 1
        return True


def _event_id(events: Sequence[KVCacheEvent], k: int) -> int:
    return events.event_id(k) if isinstance(events, EncodedEvents) else events[k].event_id


def _restored_rank(path: Path, rank: int, entry: Any) -> tuple[ZmqEventConverter, int | None]:
    """One rank's converter and last engine seq from the state file; ValueError naming the file
    and the rank when the entry is damaged (a traceback of KeyError or TypeError before)."""
    try:
        converter = ZmqEventConverter.from_state(entry["converter"])
        last_seq = entry["last_seq"]
        if last_seq is not None and (type(last_seq) is not int or last_seq < 0):
            raise ValueError(f"last_seq {brief(last_seq)} is not a seq")
    except (KeyError, TypeError, ValueError, AttributeError, OverflowError) as exc:
        raise ValueError(f"state file {path} is unreadable: rank {rank}: {brief(exc)}") from None
    return converter, last_seq
