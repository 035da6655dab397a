"""``LiveIndex``: a :class:`~kvevents.consumer.CacheIndex` that keeps following its topic in a
background thread, for a router to embed: catch up, follow, query under its lock, read its
health (is the thread alive, does the broker answer, how far behind), track worker liveness,
capture checkpoints, stop. See ``docs`` in the README ("Embedding the index in a router").
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import msgspec
from confluent_kafka import KafkaException

from .checkpoint import Checkpoint
from .index import CacheIndex
from .liveness import DEFAULT_STALE_AFTER_S, Heard, Liveness, not_routable_workers, observe_liveness
from .reader import EventReader, ReaderError
from .reader_metrics import ReaderMetrics, ReaderProgress
from .workers import WorkerKey

__all__ = ["DEFAULT_READY_MAX_LAG", "FollowerHealth", "LiveIndex", "observe_liveness"]

log = logging.getLogger(__name__)

DEFAULT_READY_MAX_LAG = 1000
"""Messages behind the broker's high watermark a ready follower may be (at the producers' usual
rate, well under a second of events)."""


class FollowerHealth(msgspec.Struct, frozen=True):
    """``ready``: the follower thread is alive, the broker answered its last probe (within
    ``probe_interval_s`` + ``probe_timeout_s``), the first catch-up is done and the lag is at most
    ``max_lag``; ``reasons`` says what is missing."""

    ready: bool
    reasons: list[str]
    follower_alive: bool
    broker_ok: bool
    caught_up: bool
    lag_messages: int | None
    max_lag: int
    last_probe_age_s: float | None
    error: str | None


class LiveIndex:
    """An index following ``topic``: ``start()`` catches up (from ``checkpoint``'s state and
    offsets, or from the beginning) then follows in a thread; query ``index`` while holding
    ``lock``; ``stop()`` ends the thread; ``checkpoint()`` captures state and offsets.

    Start from ``checkpoint`` (its liveness too, when it carries it), or from ``index`` and the
    ``offsets`` (and ``liveness``, :meth:`Liveness.saved`) it reflects (e.g. a copy shared by a
    parent process), or from an empty index and the beginning of the topic.
    ``config``: librdkafka settings of the reader. ``stale_after_s``: silence after which an instance's workers are stale (routing leaves them
    out); ``max_ready_lag``: messages of lag :meth:`health` still calls ready.
    """

    def __init__(
        self,
        bootstrap_servers: str,
        topic: str,
        *,
        checkpoint: Checkpoint | None = None,
        index: CacheIndex | None = None,
        offsets: Mapping[int, int] | None = None,
        liveness: Mapping[str, Heard] | None = None,
        core: str = "auto",
        config: Mapping[str, Any] | None = None,
        stale_after_s: float = DEFAULT_STALE_AFTER_S,
        max_ready_lag: int = DEFAULT_READY_MAX_LAG,
        probe_interval_s: float = 1.0,
        probe_timeout_s: float = 2.0,
        poll_s: float = 0.2,
        restart_after_s: float = 2.0,
    ) -> None:
        self.bootstrap_servers = bootstrap_servers
        self.topic = topic
        if checkpoint is not None and (index is not None or liveness is not None):
            raise ValueError(
                "give a checkpoint, or an index with the offsets (and liveness) it reflects, not both"
            )
        if index is not None:
            self.index = index
            self._start: str | Mapping[int, int] = dict(offsets) if offsets is not None else "beginning"
        else:
            self.index = checkpoint.index(core=core) if checkpoint is not None else CacheIndex(core=core)
            self._start = checkpoint.offsets if checkpoint is not None else "beginning"
        self._config = dict(config or {})
        self.lock = threading.Lock()
        self.liveness = Liveness(stale_after_s)
        heard = checkpoint.liveness if checkpoint is not None else liveness
        if heard is not None:
            self.liveness.restore(heard)
        self.max_ready_lag = max_ready_lag
        self.probe_interval_s = probe_interval_s
        self.probe_timeout_s = probe_timeout_s
        self.poll_s = poll_s
        self.restart_after_s = restart_after_s
        self.error: str | None = None
        self.failures = 0
        self._failed = False
        self.closed_instances = 0
        self._reader: EventReader | None = None
        self._caught_up = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._metrics: ReaderMetrics | None = None
        self._last_probe_ok: float | None = None
        self._lag: int | None = None

    # ------------------------------------------------------------------ life cycle

    @property
    def reader(self) -> EventReader:
        if self._reader is None:
            raise RuntimeError("the LiveIndex is not started")
        return self._reader

    def start(
        self, *, catch_up: bool = True, progress: Callable[[ReaderProgress], None] | None = None
    ) -> None:
        """Open the reader; with ``catch_up``, apply the topic up to its current end here (this
        thread, ``progress`` every second); then follow in the background. Raises
        :class:`ReaderError` (no broker, no topic, bad offsets)."""
        if self._reader is not None:
            raise RuntimeError("the LiveIndex is already started")
        self._reader = EventReader(self.bootstrap_servers, self.topic, start=self._start, config=self._config)
        if catch_up:
            self._reader.apply_to(self.index, lock=self.lock, on_message=self._on_message, progress=progress)
            self._caught_up = self._reader.caught_up
        self._record(self._reader.probe(self.probe_timeout_s))
        self._thread = threading.Thread(target=self._run, name="kvevents-live-index", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """End the follower thread (the reader stays open for :meth:`checkpoint`)."""
        self._stop.set()
        if self._reader is not None:
            self._reader.stop()
        if self._thread is not None:
            self._thread.join(timeout)

    def close(self) -> None:
        """Stop, then close the reader."""
        self.stop()
        if self._reader is not None:
            self._reader.close()

    def __enter__(self) -> LiveIndex:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ the thread

    def _on_message(self, message: Any) -> None:
        if observe_liveness(self.liveness, self.index, message) is not None:
            self.closed_instances += 1

    def _run(self) -> None:
        """Follow until stopped; after a failure (``error`` says which), wait ``restart_after_s``
        and go on with a new reader from the offsets applied so far."""
        while not self._stop.is_set():
            try:
                self._follow()
                return
            except (ReaderError, KafkaException, RuntimeError, ValueError, OSError) as exc:
                self.error = f"{type(exc).__name__}: {exc}"
                self.failures += 1
                log.error("the index stopped following %r: %s; restarting in %.1f s", self.topic,
                          self.error, self.restart_after_s)  # fmt: skip
            self._failed = True
            if self._stop.wait(self.restart_after_s):
                return
            try:
                old = self.reader
                offsets = old.offsets()
                old.close()
                self._reader = EventReader(
                    self.bootstrap_servers, self.topic, start=offsets, config=self._config
                )
            except (ReaderError, KafkaException, RuntimeError, ValueError, OSError) as exc:
                self.error = f"{type(exc).__name__}: {exc}"
                log.error("cannot reopen the reader of %r: %s", self.topic, self.error)
                continue
            self._failed = False

    def _follow(self) -> None:
        reader = self.reader
        next_probe = 0.0
        while not self._stop.is_set():
            reader.apply_to(
                self.index,
                until_caught_up=not self._caught_up,
                timeout=self.poll_s,
                lock=self.lock,
                on_message=self._on_message,
            )
            if not self._caught_up and reader.caught_up:
                self._caught_up = True
            now = time.monotonic()
            if now >= next_probe:
                self._record(reader.probe(self.probe_timeout_s))
                next_probe = now + self.probe_interval_s

    def _record(self, highs: dict[int, int] | None) -> None:
        reader = self.reader
        if highs is not None:
            self._last_probe_ok = time.monotonic()
            positions = reader.offsets()
            self._lag = sum(max(0, high - positions.get(p, 0)) for p, high in highs.items())
        self._metrics = reader.metrics()

    # ------------------------------------------------------------------ state

    @property
    def alive(self) -> bool:
        """Whether the follower thread runs and is following (not waiting to restart)."""
        return self._thread is not None and self._thread.is_alive() and not self._failed

    @property
    def caught_up(self) -> bool:
        """Whether the first catch-up (to the topic's end at start) is done."""
        return self._caught_up

    def metrics(self) -> ReaderMetrics | None:
        """The reader's figures as of the follower's last probe (about every second)."""
        return self._metrics

    def health(self) -> FollowerHealth:
        reasons = []
        alive = self.alive
        if not alive:
            reasons.append(
                "the follower is not running" + (f" (last error: {self.error})" if self.error else "")
            )
        age = None if self._last_probe_ok is None else time.monotonic() - self._last_probe_ok
        broker_ok = age is not None and age <= self.probe_interval_s + self.probe_timeout_s + 0.5
        if not broker_ok:
            reasons.append("the broker did not answer the last probe")
        if not self._caught_up:
            reasons.append("the index has not caught up with the topic yet")
        lag = self._lag
        if lag is not None and lag > self.max_ready_lag:
            reasons.append(f"lag {lag} messages > {self.max_ready_lag}")
        return FollowerHealth(
            ready=not reasons,
            reasons=reasons,
            follower_alive=alive,
            broker_ok=broker_ok,
            caught_up=self._caught_up,
            lag_messages=lag,
            max_lag=self.max_ready_lag,
            last_probe_age_s=None if age is None else round(age, 3),
            error=self.error,
        )

    def not_routable(self, now: float | None = None) -> dict[WorkerKey, str]:
        """Workers routing must leave out now (stale or closed instance), with the state. Call
        under ``lock``."""
        return not_routable_workers(self.index, self.liveness, now)

    def checkpoint(self) -> Checkpoint:
        """State, liveness and offsets now (under ``lock``; a message applied but not yet
        counted in the offsets is replayed on restore, which changes nothing)."""
        with self.lock:
            return Checkpoint.capture(self.index, self.reader, self.liveness)
