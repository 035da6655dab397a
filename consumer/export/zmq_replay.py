"""The replay ROUTER of ``kvevents export zmq``: vLLM's replay protocol answered from Kafka.

A DEALER sends ``[b"", start_seq (8 bytes BE), (topic)]``; the answer re-converts the topic from
the exporter's newest replay anchor at or before that seq up to the live position, and sends
each of the publisher's batches from ``start_seq`` on, then the end marker. Answers go out
without blocking, several at a time (``replay_max_pending``, one per client); see
:class:`ReplayServer`.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..reader import EventReader
from ..workers import WorkerKey
from .convert import VllmConverter
from .vllm_wire import END_SEQ
from .zmq_streams import Pipeline, stream_key, stream_topic

if TYPE_CHECKING:
    from .zmq_export import ZmqExporter

__all__ = ["REPLAY_SEND_TIMEOUT_S", "ReplayServer"]

log = logging.getLogger(__name__)

REPLAY_SEND_TIMEOUT_S = 10.0
"""How long a replay answer waits for a client that reads nothing before it is abandoned."""


def _power_of_two(count: int) -> bool:
    return count & (count - 1) == 0


@dataclass
class _Answer:
    """A replay answer being sent: its frames (the end marker last) and how far it got."""

    sock: Any
    start_seq: int
    frames: list[list[bytes]]
    sent: int = 0
    last_progress: float = field(default_factory=time.monotonic)


class ReplayServer(threading.Thread):
    """Answers replay requests on every publisher's ROUTER socket.

    A ROUTER drops, silently, what goes past a slow client's high-water mark and still sends
    the end marker: the client would see an answer with a hole in it. So the sockets route
    mandatorily (a full pipe refuses the send) and answers are sent without blocking: what a
    client cannot take yet waits in its answer while the others go on; one that takes nothing
    for ``REPLAY_SEND_TIMEOUT_S``, or has gone, is abandoned (no end marker) and counted."""

    def __init__(self, exporter: ZmqExporter) -> None:
        super().__init__(name="kvevents-export-replay", daemon=True)
        self.exporter = exporter
        self._stopping = threading.Event()
        zmq = exporter._zmq
        self._routers: list[tuple[Any, int]] = []
        for index, (_, endpoint) in enumerate(exporter._publishers):
            if endpoint is not None:
                router = exporter._open(zmq.ROUTER, endpoint)
                router.setsockopt(zmq.ROUTER_MANDATORY, 1)
                self._routers.append((router, index))

    def stop(self) -> None:
        self._stopping.set()
        self.join(timeout=5)

    def run(self) -> None:
        zmq = self.exporter._zmq
        poller = zmq.Poller()
        for sock, _ in self._routers:
            poller.register(sock, zmq.POLLIN)
        pending: list[_Answer] = []
        while not self._stopping.is_set():
            ready = dict(poller.poll(5 if pending else 100))
            for sock, index in self._routers:
                if sock not in ready:
                    continue
                frames = sock.recv_multipart()
                if self._refused(sock, frames, pending):
                    continue
                try:
                    answer = self._answer(sock, index, frames)
                except Exception:
                    log.exception("replay request failed")
                    continue
                pending.append(answer)
            pending = [answer for answer in pending if not self._push(answer)]

    def _refused(self, sock: Any, frames: list[bytes], pending: list[_Answer]) -> bool:
        """Whether this request goes unanswered: invalid, too many answers in progress, or one
        to the same client still is. Counted; logged at the 1st, 2nd, 4th, 8th... of each."""
        stats = self.exporter.stats
        if len(frames) not in (3, 4) or frames[1] != b"" or len(frames[2]) != 8:
            stats.replay_requests_invalid += 1
            if _power_of_two(stats.replay_requests_invalid):
                log.warning(
                    "invalid replay request (%d frames): expected [b'', start_seq, (topic)] (%d so far)",
                    len(frames),
                    stats.replay_requests_invalid,
                )
            return True
        if any(a.sock is sock and a.frames[0][0] == frames[0] for a in pending):
            why = "its client's earlier answer is still going out"
        elif len(pending) >= self.exporter.config.replay_max_pending:
            why = f"{len(pending)} answers are in progress (replay_max_pending)"
        else:
            return False
        stats.replays_refused += 1
        if _power_of_two(stats.replays_refused):
            log.warning("replay request refused: %s (%d refused so far)", why, stats.replays_refused)
        return True

    def _answer(self, sock: Any, index: int, frames: list[bytes]) -> _Answer:
        """The answer to one valid request."""
        exporter = self.exporter
        client, start_seq = frames[0], int.from_bytes(frames[2], "big")
        only = frames[3] if len(frames) == 4 else None
        three = exporter.config.replay_frames == 3
        out = [
            [client, b"", topic, seq, payload] if three else [client, b"", seq, payload]
            for topic, seq, payload in self.replay(index, start_seq, only)
        ]
        end = END_SEQ.to_bytes(8, "big")
        out.append([client, b"", only or b"", end, b""] if three else [client, b"", end, b""])
        return _Answer(sock, start_seq, out)

    def _push(self, answer: _Answer) -> bool:
        """Send what the client takes now; True once the answer is done with (sent or abandoned)."""
        zmq, stats = self.exporter._zmq, self.exporter.stats
        start = answer.sent
        try:
            while answer.sent < len(answer.frames):
                answer.sock.send_multipart(answer.frames[answer.sent], flags=zmq.NOBLOCK)
                answer.sent += 1
        except zmq.Again:  # the client's pipe is full: later, unless it stopped reading
            now = time.monotonic()
            if answer.sent > start:
                answer.last_progress = now
            if now - answer.last_progress < REPLAY_SEND_TIMEOUT_S:
                return False
            why = f"it read nothing for {REPLAY_SEND_TIMEOUT_S:.0f} s"
        except zmq.ZMQError as exc:  # EHOSTUNREACH: the client has gone
            why = str(exc)
        else:
            batches = len(answer.frames) - 1
            stats.replays += 1
            stats.replayed_batches += batches
            log.info("replay from seq %d: %d batches", answer.start_seq, batches)
            return True
        stats.replays_abandoned += 1
        stats.replayed_batches += answer.sent
        log.warning(
            "replay from seq %d abandoned after %d batches (%s): the client gets no end marker",
            answer.start_seq,
            answer.sent,
            why,
        )
        return True

    def replay(self, index: int, start_seq: int, only: bytes | None) -> list[tuple[bytes, bytes, bytes]]:
        """Re-convert the topic from the anchor up to the live position; the batches of
        publisher ``index`` (topic ``only``) with ``seq >= start_seq``."""
        exporter = self.exporter
        cfg = exporter.config
        target, live_seqs = exporter.live_position()
        prefix = f"{index}:"
        wanted = [
            k for k in live_seqs if k.startswith(prefix) and (only is None or k == stream_key(index, only))
        ]
        out: list[tuple[bytes, bytes, bytes]] = []
        anchor = exporter.anchor_for(wanted, start_seq)
        if anchor is None:
            log.warning("cannot replay from seq %d: retention deleted the data of every anchor", start_seq)
            return out
        if any(anchor.seqs.get(k, 0) > start_seq for k in wanted):
            log.warning(
                "replay from seq %d: the topic no longer holds the batches before the oldest anchor "
                "(seqs %s); answering from there",
                start_seq,
                {k: anchor.seqs.get(k, 0) for k in wanted},
            )
        converter = VllmConverter(
            exporter.wire, VllmConverter.state_from_bytes(anchor.converter), lora_names=cfg.lora_names
        )
        pipeline = Pipeline(converter, cfg.codec)
        seqs = dict(anchor.seqs)
        if all(target.get(p, 0) <= o for p, o in anchor.offsets.items()):
            return out
        topics: dict[WorkerKey, tuple[bytes, int | None]] = {}
        reader = EventReader(
            cfg.bootstrap_servers, cfg.topic, start=anchor.offsets, config=cfg.reader_config, codec=cfg.codec
        )
        deadline = time.monotonic() + cfg.replay_timeout_s
        try:
            starts = reader.offsets()
            if any(starts.get(p, o) > o for p, o in anchor.offsets.items()):
                log.warning("cannot replay: retention deleted batches after the anchor %s", anchor.offsets)
                return out  # deleted between choosing the anchor and opening the reader
            positions = dict(anchor.offsets)
            while any(positions.get(p, 0) < t for p, t in target.items()):
                if time.monotonic() > deadline or self._stopping.is_set():
                    log.warning("replay stopped early (timeout %.0f s or shutdown)", cfg.replay_timeout_s)
                    break
                for message in reader.messages(timeout=0.5):
                    p, offset = message.partition(), message.offset()
                    if offset >= target.get(p, 0):
                        continue
                    positions[p] = offset + 1
                    ts, converted = pipeline.handle(message)
                    for key, events in converted.items():
                        if key not in topics:
                            name = stream_topic(cfg.topic_template, key, cfg.model, cfg.pod_ids).encode(
                                "utf-8"
                            )
                            topics[key] = (name, exporter.publisher_of(key))
                        topic, publisher = topics[key]
                        if publisher is None:
                            continue
                        name_s = stream_key(publisher, topic)
                        seq = seqs.get(name_s, 0)
                        seqs[name_s] = seq + 1
                        if (
                            publisher == index
                            and seq >= start_seq
                            and seq < live_seqs.get(name_s, 0)
                            and (only is None or only == topic)
                        ):
                            payload = exporter.wire.encode(ts, events, key[1])
                            out.append((topic, seq.to_bytes(8, "big"), payload))
                    if not any(positions.get(q, 0) < t for q, t in target.items()):
                        break
        finally:
            reader.close()
        return out
