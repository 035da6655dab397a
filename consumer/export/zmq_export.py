"""``kvevents export zmq``: the topic republished in vLLM's ZMQ wire format, with replay from Kafka.

Streams. Each worker (instance, attention-DP rank) gets its own ZMQ topic (``topic_template``,
default llm-d's ``kv@<pod>@<model>``; ``pod`` is the instance id, with ``-dp<rank>`` for ranks
above 0). Seqs count from 0 without gaps per (publisher, topic) (:func:`stream_key`), so with the
default template every worker's stream has its own. A worker goes to
its own PUB socket when ``workers`` maps it to one (vLLM's one publisher per rank), else to the
shared PUB (``pub``), else it is skipped and counted. Sockets bind or connect.

Seqs across restarts: with ``state_path`` the exporter saves its offsets, seqs and converter
memory every ``checkpoint_interval_s`` and on close, and resumes from them (see
:mod:`.state`).

Replay. A publisher with a replay endpoint answers vLLM's protocol on a ROUTER socket: a DEALER
sends ``[b"", start_seq (8 bytes BE)]`` (optionally a third frame: one ZMQ topic) and receives
``[b"", topic, seq, payload]`` per batch of that publisher's streams with ``seq >= start_seq``
(``replay_frames=2``: ``[b"", seq, payload]``), then ``[b"", (topic,) 0xff*8, b""]``. The batches
come from Kafka, re-converted from a replay *anchor* (:mod:`.anchors`: one per checkpoint, kept
in files beside the state across restarts, thinned to ``replay_anchors``, forgotten when retention
deletes their data), so every seq whose batch the topic still holds can be answered, from before
a restart too.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvevents.schemas import DecodeError, decode_batch

from ..reader import EventReader
from ..workers import WorkerKey
from .anchors import AnchorStore
from .convert import VllmConverter
from .state import Anchor, ExportState, load_state, save_state
from .vllm_wire import END_SEQ, VllmWire

__all__ = ["Endpoint", "ExportStats", "ZmqExportConfig", "ZmqExporter", "stream_key", "stream_topic"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Endpoint:
    """A ZMQ address and whether to bind it (else connect)."""

    address: str
    bind: bool = True


@dataclass
class ZmqExportConfig:
    """What to read and where to publish (see the module docstring)."""

    bootstrap_servers: str
    topic: str
    pub: Endpoint | None = None
    replay: Endpoint | None = None
    workers: Mapping[WorkerKey, tuple[Endpoint, Endpoint | None]] = field(default_factory=dict)
    model: str = "model"
    topic_template: str = "kv@{pod}@{model}"
    positional: bool = True
    """Events as arrays (what every llm-d release reads); False: vLLM's current tagged maps."""
    replay_frames: int = 3
    start: str | Mapping[int, int] = "beginning"
    """"beginning", "end", or ``{partition: offset}`` (e.g. an index checkpoint's offsets)."""
    state_path: Path | None = None
    checkpoint_interval_s: float = 5.0
    reader_config: Mapping[str, Any] | None = None
    codec: Any = None
    """What decodes messages (a ``RegistryCodec`` reads both framings); default single-object."""
    hwm: int = 100_000
    replay_timeout_s: float = 120.0
    start_delay_s: float = 0.0
    """Seconds between opening the sockets and the first publish (subscribers connect)."""
    lora_names: Mapping[int, str] = field(default_factory=dict)
    """LoRA id -> adapter name, sent as vLLM's ``lora_name``."""
    replay_anchors: int = 64
    """Replay starting points kept at most (one is taken per checkpoint; see :mod:`.anchors`);
    without ``state_path`` they are kept in memory, 16 at most."""
    pod_ids: Mapping[WorkerKey, str] = field(default_factory=dict)
    """A worker's ``{pod}`` in topics, as the router names the engine (llm-d: the pod's
    ``ip:port``, each data-parallel rank its own port); default: the instance id, ``-dp<rank>``
    added for ranks above 0."""
    replay_max_pending: int = 8
    """Replay answers in progress at most (each is held in memory until its client has read
    it); a request past it, or from a client whose answer is still going out, is refused:
    no answer (the client's timeout retries), counted in ``replays_refused``."""

    def __post_init__(self) -> None:
        if self.pub is None and not self.workers:
            raise ValueError("nowhere to publish: give a shared PUB endpoint or per-worker endpoints")
        if self.replay is not None and self.pub is None:
            raise ValueError(
                "a replay endpoint belongs to the shared PUB: give --pub too (or a --worker replay)"
            )
        if self.replay_frames not in (2, 3):
            raise ValueError(f"replay_frames must be 2 or 3, got {self.replay_frames}")
        if self.replay_max_pending < 1:
            raise ValueError(f"replay_max_pending must be at least 1, got {self.replay_max_pending}")
        if isinstance(self.start, str) and self.start not in ("beginning", "end"):
            raise ValueError(f"start must be 'beginning', 'end' or partition offsets, got {self.start!r}")


def stream_topic(
    template: str, key: WorkerKey, model: str, pod_ids: Mapping[WorkerKey, str] | None = None
) -> str:
    """The ZMQ topic of a worker's stream; ``{pod}`` is ``pod_ids``' name for the worker, else the
    instance id, ``-dp<rank>`` added for ranks above 0."""
    pod = pod_ids.get(key) if pod_ids else None
    if pod is None:
        pod = (
            key.instance_id if key.attention_dp_rank == 0 else f"{key.instance_id}-dp{key.attention_dp_rank}"
        )
    return template.format(pod=pod, instance=key.instance_id, rank=key.attention_dp_rank, model=model)


def stream_key(publisher: int, topic: bytes) -> str:
    """A stream's name in ``ZmqExporter.seqs`` and the state file: its publisher (0: the shared
    PUB, then the ``workers`` in order) and ZMQ topic. Each has its own seq, as each vLLM
    publisher has, so workers that share a topic on one publisher share its seq."""
    return f"{publisher}:{topic.decode('utf-8')}"


@dataclass
class ExportStats:
    """What one run published."""

    messages_read: int = 0
    malformed: int = 0
    batches_published: int = 0
    events_published: int = 0
    unrouted_batches: int = 0
    replays: int = 0
    replayed_batches: int = 0
    replays_abandoned: int = 0
    """Answers cut short: the client read nothing for ``REPLAY_SEND_TIMEOUT_S`` or went away
    (it gets no end marker, so it sees an incomplete answer, not a silent hole)."""
    replays_refused: int = 0
    """Requests not answered: ``replay_max_pending`` answers were in progress, or the client's
    own earlier answer still was (a flood of requests costs no re-read of the topic)."""
    replay_requests_invalid: int = 0
    """Requests that were not ``[b"", start_seq (8 bytes), (topic)]``."""
    seconds: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)


class _Pipeline:
    """Kafka messages -> (worker, events) with deterministic handling of bad messages; shared
    by the live exporter and replays so both number a stream's batches the same way."""

    def __init__(self, converter: VllmConverter, codec: Any = None) -> None:
        self.converter = converter
        self.malformed = 0
        self._decode = decode_batch if codec is None else codec.decode_batch

    def handle(self, message: Any) -> tuple[float, dict[WorkerKey, list[Any]]]:
        """(the batch's creation time in seconds, its vLLM events per worker)."""
        try:
            value = message.value()
            if value is None:
                raise DecodeError("empty message (a tombstone?)")
            batch = self._decode(value)
        except DecodeError as exc:
            self.malformed += 1
            key = message.key()
            log.warning(
                "skipped a malformed message at %s[%d]@%d: %s",
                message.topic(),
                message.partition(),
                message.offset(),
                exc,
            )
            ts = message.timestamp()[1] / 1000.0
            if not key:
                return ts, {}
            instance = key.decode("utf-8", "replace")
            return ts, self.converter.lose_instance(
                instance, "a malformed message of this instance was skipped"
            )
        ts = batch.created_at_us / 1e6 if batch.created_at_us > 0 else message.timestamp()[1] / 1000.0
        return ts, self.converter.convert(batch)


class ZmqExporter:
    """Reads the topic and publishes every worker's stream (module docstring)."""

    def __init__(self, config: ZmqExportConfig, *, context: Any = None) -> None:
        import zmq  # the 'bridge' extra

        self.config = config
        self._zmq = zmq
        self._ctx = context or zmq.Context.instance()
        self.wire = VllmWire(config.positional)
        self.stats = ExportStats()
        self._lock = threading.Lock()
        self._closed = False
        self._sockets: list[Any] = []
        self._routes: dict[WorkerKey, tuple[Any, bytes, int] | None] = {}
        state = None if config.state_path is None else load_state(config.state_path, config.topic)
        converter_state = None if state is None else VllmConverter.state_from_bytes(state.converter)
        self.converter = VllmConverter(
            self.wire, converter_state, on_loss=self._lost, lora_names=config.lora_names
        )
        self._pipeline = _Pipeline(self.converter, config.codec)
        self.seqs: dict[str, int] = {} if state is None else dict(state.seqs)
        start: Any = config.start if state is None else state.offsets
        self._reader = EventReader(
            config.bootstrap_servers,
            config.topic,
            start=start,
            config=config.reader_config,
            codec=config.codec,
        )
        self.offsets: dict[int, int] = self._reader.offsets()
        path = config.state_path
        self.anchors = (  # in memory without a state file: as many as before files (16)
            AnchorStore(None, min(config.replay_anchors, 16))
            if path is None
            else AnchorStore(path.with_name(path.name + ".anchors"), config.replay_anchors)
        )
        """Replay starting points (files beside the state, when there is one)."""
        self._anchors_lock = threading.Lock()
        if state is None and len(self.anchors):  # seqs start from 0 again: old anchors would lie
            log.warning(
                "no export state: forgetting %d replay anchors of an earlier numbering", len(self.anchors)
            )
            self.anchors.clear()
        if not len(self.anchors):  # the first start: replays reach back to here
            self.anchors.add(Anchor(dict(self.offsets), dict(self.seqs), self.converter.state_bytes()))
        self._last_save = time.monotonic()
        self._replay: _ReplayServer | None = None
        try:
            self._publishers = self._open_publishers()
            if any(r is not None for _, r in self._publishers):
                self._replay = _ReplayServer(self)
        except BaseException:
            self.close()
            raise
        if self._replay is not None:
            self._replay.start()
        if config.start_delay_s > 0:
            time.sleep(config.start_delay_s)

    # ------------------------------------------------------------------ sockets

    def _open(self, kind: int, endpoint: Endpoint) -> Any:
        sock = self._ctx.socket(kind)
        self._sockets.append(sock)
        sock.setsockopt(self._zmq.LINGER, 1000)
        if kind == self._zmq.PUB:
            sock.set_hwm(self.config.hwm)
        if endpoint.bind:
            sock.bind(endpoint.address)
        else:
            sock.connect(endpoint.address)
        return sock

    def _open_publishers(self) -> list[tuple[Any, Endpoint | None]]:
        """Index 0: the shared PUB (or None); then one per configured worker."""
        cfg = self.config
        publishers: list[tuple[Any, Endpoint | None]] = [
            (None if cfg.pub is None else self._open(self._zmq.PUB, cfg.pub), cfg.replay)
        ]
        self._worker_pub: dict[WorkerKey, int] = {}
        for key, (pub, replay) in cfg.workers.items():
            publishers.append((self._open(self._zmq.PUB, pub), replay))
            self._worker_pub[WorkerKey(*key)] = len(publishers) - 1
        return publishers

    def publisher_of(self, key: WorkerKey) -> int | None:
        """Which publisher carries ``key``'s stream (None: none does)."""
        index = self._worker_pub.get(key)
        if index is not None:
            return index
        return 0 if self._publishers[0][0] is not None else None

    def _route(self, key: WorkerKey) -> tuple[Any, bytes, int] | None:
        route = self._routes.get(key, False)
        if route is False:
            index = self.publisher_of(key)
            cfg = self.config
            topic = stream_topic(cfg.topic_template, key, cfg.model, cfg.pod_ids)
            route = None if index is None else (self._publishers[index][0], topic.encode("utf-8"), index)
            self._routes[key] = route
        return route  # type: ignore[return-value]

    # ------------------------------------------------------------------ running

    def _lost(self, key: WorkerKey, reason: str) -> None:
        log.warning("%s/%d: events were lost (%s): publishing AllBlocksCleared", key[0], key[1], reason)

    def run(
        self,
        *,
        until_caught_up: bool = False,
        timeout: float | None = None,
        max_messages: int | None = None,
        progress: Callable[[ExportStats], None] | None = None,
        progress_interval_s: float = 5.0,
    ) -> ExportStats:
        """Publish until caught up (or :meth:`stop`, ``timeout``, ``max_messages``)."""
        stats = self.stats
        started = time.monotonic()
        next_progress = started + progress_interval_s
        handle = self._pipeline.handle
        encode = self.wire.encode
        seqs = self.seqs
        for message in self._reader.messages(
            until_caught_up=until_caught_up, timeout=timeout, max_messages=max_messages
        ):
            stats.messages_read += 1
            ts, out = handle(message)
            with self._lock:  # replays read offsets and seqs together
                for key, events in out.items():
                    route = self._route(key)
                    if route is None:
                        stats.unrouted_batches += 1
                        continue
                    sock, topic, index = route
                    name = stream_key(index, topic)
                    seq = seqs.get(name, 0)
                    sock.send_multipart((topic, seq.to_bytes(8, "big"), encode(ts, events, key[1])))
                    seqs[name] = seq + 1
                    stats.batches_published += 1
                    stats.events_published += len(events)
                self.offsets[message.partition()] = message.offset() + 1
            now = time.monotonic()
            if now - self._last_save >= self.config.checkpoint_interval_s:
                self._checkpoint()
            if progress is not None and now >= next_progress:
                stats.seconds += now - started
                started = now
                progress(stats)
                next_progress = now + progress_interval_s
        stats.malformed = self._pipeline.malformed
        stats.seconds += time.monotonic() - started
        return stats

    def live_position(self) -> tuple[dict[int, int], dict[str, int]]:
        """(offsets, seqs) published so far, consistent with each other (for replays)."""
        with self._lock:
            return dict(self.offsets), dict(self.seqs)

    def _checkpoint(self) -> None:
        """Every ``checkpoint_interval_s``: a new replay anchor here, and the state saved."""
        offsets, seqs = self.live_position()
        converter = self.converter.state_bytes()
        with self._anchors_lock:
            self.anchors.add(Anchor(offsets, seqs, converter))
        self._save(offsets, seqs, converter)

    def save(self) -> None:
        """Save the restart state now (no-op without ``state_path``)."""
        offsets, seqs = self.live_position()
        self._save(offsets, seqs, self.converter.state_bytes() if self.config.state_path else b"")

    def _save(self, offsets: dict[int, int], seqs: dict[str, int], converter: bytes) -> None:
        self._last_save = time.monotonic()
        path = self.config.state_path
        if path is not None:
            save_state(path, ExportState(self.config.topic, offsets, seqs, converter))

    def anchor_for(self, streams: list[str], start_seq: int) -> Anchor | None:
        """Where a replay of ``streams`` from ``start_seq`` re-reads the topic from: the newest
        anchor at or before it whose data is retained (else the oldest retained one; None if
        retention deleted the data of every anchor). Anchors whose data is gone are forgotten."""
        cfg = self.config
        with EventReader(cfg.bootstrap_servers, cfg.topic, config=cfg.reader_config) as probe:
            log_start = probe.offsets()  # read from the beginning: the low watermarks
        with self._anchors_lock:
            gone = self.anchors.prune(log_start)
            if gone:
                log.info("retention deleted the data of %d replay anchors: forgotten", gone)
            return self.anchors.choose(streams, start_seq, log_start)

    def stop(self) -> None:
        """Make :meth:`run` return soon (thread-safe)."""
        self._reader.stop()

    def close(self) -> None:
        """Save the state, stop the replay server, close sockets and the reader. Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            if hasattr(self, "_publishers"):
                self.save()
        finally:
            replay = getattr(self, "_replay", None)
            if replay is not None and replay.is_alive():
                replay.stop()
            for sock in self._sockets:
                sock.close()
            self._reader.close()

    def __enter__(self) -> ZmqExporter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


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


class _ReplayServer(threading.Thread):
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
        pipeline = _Pipeline(converter, cfg.codec)
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
