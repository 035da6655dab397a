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

from ..reader import EventReader
from ..workers import WorkerKey
from .anchors import DEFAULT_MAX_BYTES, AnchorStore
from .convert import VllmConverter
from .state import Anchor, ExportState, load_state, save_state
from .vllm_wire import VllmWire
from .zmq_replay import ReplayServer
from .zmq_streams import Pipeline, stream_key, stream_topic

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
    replay_anchor_bytes: int = DEFAULT_MAX_BYTES
    """Bytes of converter state (every held block's tokens, once per anchor) the anchors keep
    at most, in memory or on disk; past it inner anchors go (the oldest and newest stay)."""
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
        converter_state = None
        if state is not None:
            try:
                converter_state = VllmConverter.state_from_bytes(state.converter)
            except ValueError as exc:  # msgspec's DecodeError: the checksum-free inner blob
                raise ValueError(f"{config.state_path}: corrupt converter state: {exc}") from None
        self.converter = VllmConverter(
            self.wire, converter_state, on_loss=self._lost, lora_names=config.lora_names
        )
        self._pipeline = Pipeline(self.converter, config.codec)
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
            AnchorStore(None, min(config.replay_anchors, 16), config.replay_anchor_bytes)
            if path is None
            else AnchorStore(
                path.with_name(path.name + ".anchors"), config.replay_anchors, config.replay_anchor_bytes
            )
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
        self._replay: ReplayServer | None = None
        try:
            self._publishers = self._open_publishers()
            if any(r is not None for _, r in self._publishers):
                self._replay = ReplayServer(self)
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
