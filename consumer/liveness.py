"""Worker liveness, per engine instance: *live* (heard from within ``stale_after_s``), *stale*
(silent longer: routing leaves its workers out), *closed* (its producer said goodbye with a
``kvevents-control: close`` header: its workers leave the index).

Every message counts as a sign of life, heartbeats (batches with no events) included. Time is
the message's Kafka timestamp (the producer's clock; the receive time when a message has none),
so replicas reading the same topic agree and a rebuild sees old instances as stale at once.
Stale is not degraded: a degraded worker's view may be incomplete (lost events), a stale one's
may be out of date. Kept beside the index, not in it; a checkpoint carries it (:meth:`Liveness.saved`,
:meth:`Liveness.restore`), so a restart keeps closed instances closed and the original clock. An
instance never heard (e.g. from an older checkpoint without it) counts as heard when tracking started.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any, Literal

import msgspec

if TYPE_CHECKING:
    from .index import CacheIndex
    from .workers import WorkerKey

__all__ = [
    "CONTROL_CLOSE",
    "CONTROL_HEADER",
    "DEFAULT_STALE_AFTER_S",
    "Heard",
    "InstanceLiveness",
    "Liveness",
    "not_routable_workers",
    "observe_liveness",
]

CONTROL_HEADER = "kvevents-control"
"""Kafka header of control signals (the producer's ``KafkaEventSink`` writes the same name)."""
CONTROL_CLOSE = b"close"
DEFAULT_STALE_AFTER_S = 15.0
"""Three of the sink's default 5-second heartbeats."""

State = Literal["live", "stale", "closed"]


class InstanceLiveness(msgspec.Struct, frozen=True):
    """What is known of one instance: when it was last heard (seconds since the epoch), how many
    messages came from it, whether it closed, and its state at the time asked."""

    instance_id: str
    last_heard_s: float
    messages: int
    state: State


class Heard(msgspec.Struct, frozen=True, array_like=True):
    """What a checkpoint keeps of one instance: when it was last heard (the message timestamp,
    seconds since the epoch) and whether it closed."""

    last_heard_s: float
    closed: bool


def control_value(headers: Iterable[tuple[str, bytes | None]] | None) -> bytes | None:
    """The ``kvevents-control`` header of a message, if any."""
    for name, value in headers or ():
        if name == CONTROL_HEADER:
            return value
    return None


class Liveness:
    """Per instance: last heard, message count, closed flag. Not thread-safe: update and read it
    under the index's lock (``LiveIndex`` does)."""

    def __init__(self, stale_after_s: float = DEFAULT_STALE_AFTER_S, clock: Callable[[], float] = time.time):
        if not stale_after_s > 0:
            raise ValueError(f"stale_after_s must be > 0, got {stale_after_s!r}")
        self.stale_after_s = stale_after_s
        self._clock = clock
        self._started = clock()
        self._last: dict[str, float] = {}
        self._messages: dict[str, int] = {}
        self._closed: set[str] = set()
        self.closes = 0

    def now(self) -> float:
        """The clock liveness is judged by (seconds since the epoch)."""
        return self._clock()

    def observe(self, instance_id: str, at_s: float | None, *, closing: bool = False) -> None:
        """A message of ``instance_id`` stamped ``at_s`` (None: now); ``closing``: its last."""
        at = self._clock() if at_s is None else at_s
        if at > self._last.get(instance_id, float("-inf")):
            self._last[instance_id] = at
        self._messages[instance_id] = self._messages.get(instance_id, 0) + 1
        if closing:
            self._closed.add(instance_id)
            self.closes += 1
        else:
            self._closed.discard(instance_id)  # a restarted instance is back

    def observe_message(self, message: Any) -> str | None:
        """A ``confluent_kafka.Message`` (key: the instance id); the instance id if it says it
        closes, else None. Messages without a key are not attributed."""
        key = message.key()
        if not key:
            return None
        instance = key.decode("utf-8", "replace")
        kind, stamp_ms = message.timestamp()
        closing = control_value(message.headers()) == CONTROL_CLOSE
        self.observe(instance, stamp_ms / 1000.0 if kind and stamp_ms > 0 else None, closing=closing)
        return instance if closing else None

    def saved(self) -> dict[str, Heard]:
        """Every instance heard: last heard and closed flag (what a checkpoint keeps)."""
        return {i: Heard(at, i in self._closed) for i, at in self._last.items()}

    def restore(self, saved: Mapping[str, Heard]) -> None:
        """Take :meth:`saved`'s state (before observing anything: it replaces what is known)."""
        self._last = {i: h.last_heard_s for i, h in saved.items()}
        self._closed = {i for i, h in saved.items() if h.closed}

    def state(self, instance_id: str, now: float | None = None) -> State:
        if instance_id in self._closed:
            return "closed"
        now = self._clock() if now is None else now
        last = self._last.get(instance_id, self._started)
        return "stale" if now - last > self.stale_after_s else "live"

    def instance(self, instance_id: str, now: float | None = None) -> InstanceLiveness:
        return InstanceLiveness(
            instance_id,
            self._last.get(instance_id, self._started),
            self._messages.get(instance_id, 0),
            self.state(instance_id, now),
        )

    def not_routable(self, instance_ids: Iterable[str], now: float | None = None) -> dict[str, State]:
        """Of ``instance_ids``, those routing must leave out (stale or closed), with their state."""
        now = self._clock() if now is None else now
        out: dict[str, State] = {}
        for instance in instance_ids:
            state = self.state(instance, now)
            if state != "live":
                out[instance] = state
        return out


def observe_liveness(liveness: Liveness, index: CacheIndex, message: Any) -> str | None:
    """Track ``message`` in ``liveness`` (an ``on_message`` of ``EventReader.apply_to``, under the
    index's lock); if its instance closes, its workers leave ``index``: returns that instance."""
    closing = liveness.observe_message(message)
    if closing is not None:
        index.reset_workers(index.workers_of([closing]), clear_degraded=True)
    return closing


def not_routable_workers(
    index: CacheIndex, liveness: Liveness, now: float | None = None
) -> dict[WorkerKey, str]:
    """The workers routing must leave out now (their instance stale or closed), with the state:
    each instance judged once, workers listed only for those left out (``route --serve`` asks
    every 0.2 s under the index lock; listing every worker cost 41 ms at 32k instances)."""
    states = liveness.not_routable(index.instances(), now)
    if not states:
        return {}
    return {key: states[key.instance_id] for key in index.workers_of(states)}
