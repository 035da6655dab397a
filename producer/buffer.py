"""``EventBuffer``: the bounded, drop-oldest buffer of built events that consumers read from.

The C++ manager's ``mEvents`` with its truncation rule (the OLDEST events go first), except that
every dropped event is counted per source rank and window size, with a high-water mark and a
rate-limited warning. Thread-safe; who calls what (worker, gather, readers, sink):
``docs/ARCHITECTURE.md``.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from array import array
from collections import deque
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import msgspec
from kvevents.schemas import KVCacheEvent, RankDrops

from .stats import BufferStats

if TYPE_CHECKING:
    from .sink_encoded import EncodedDrain, EncodedEvents

__all__ = ["DEFAULT_DROP_WARNING_INTERVAL_S", "DropListener", "EventBuffer", "EventDrain", "check_timeout"]

log = logging.getLogger(__name__)

DEFAULT_DROP_WARNING_INTERVAL_S = 10.0
"""At most one drop warning per this many seconds per buffer."""


DropListener = Callable[[int, int, "int | None"], None]
"""``listener(source_rank, dropped_events, newest_dropped_event_id)``; the id is None when not
known (drops another rank reported for its own buffer)."""


class EventDrain(msgspec.Struct, frozen=True, gc=False):
    """What :meth:`EventBuffer.drain` took: the buffered events, oldest first, and per source
    rank the events dropped since the previous drain (only ranks with drops, sorted by rank;
    ready for ``EventBatch.dropped``)."""

    events: list[KVCacheEvent]
    dropped: list[RankDrops]
    more: bool = False
    """The drain stopped before drops recorded behind its events: drain again at once (the
    next drain starts with them)."""

    @property
    def dropped_events_total(self) -> int:
        """Events dropped, all ranks together, since the previous drain."""
        return sum(d.dropped_events for d in self.dropped)


def check_timeout(timeout: float | None) -> float | None:
    """``timeout`` in seconds, checked: ``None`` (wait forever) or a finite number >= 0."""
    if timeout is None:
        return None
    if (
        isinstance(timeout, bool)
        or not isinstance(timeout, int | float)
        or math.isnan(timeout)
        or timeout < 0
    ):
        raise ValueError(f"timeout must be None or a number of seconds >= 0, got {timeout!r}")
    return float(timeout)


def _rank_key(rank: int | None) -> int:
    return 0 if rank is None else rank


def _as_objects(items: list[KVCacheEvent | _Segment], encoded: bool) -> list[KVCacheEvent]:
    """Buffer items as event objects (segments decoded)."""
    if not encoded:
        return items  # type: ignore[return-value]  # no segment among them
    events: list[KVCacheEvent] = []
    for item in items:
        if isinstance(item, _Segment):
            events += item.events.decode()
        else:
            events.append(item)
    return events


class _Segment:
    """Events of another rank as they came over the gather, still Avro (rank 0's pass-through:
    ``docs/GATHER_PROTOCOL.md``): a view of an ``EncodedEvents`` and each event's window size."""

    __slots__ = ("events", "windows")

    def __init__(self, events: EncodedEvents, windows: array[int]) -> None:
        self.events = events
        self.windows = windows

    def drop_front(self, k: int, by_key: dict[tuple[int | None, int], int], newest: dict[int, int]) -> None:
        """Count the first ``k`` events as dropped (into ``by_key`` and ``newest``) and keep the rest."""
        events = self.events
        for i in range(k):
            rank = events.rank(i)
            key = (rank, self.windows[i])
            by_key[key] = by_key.get(key, 0) + 1
            newest[rank] = events.event_id(i)
        self.events = events[k:]
        self.windows = self.windows[k:]


class EventBuffer:
    """Holds at most ``capacity`` events; drops the oldest first and counts every drop.

    ``drop_warning_interval_s`` bounds the drop warnings to one per interval (each tells how many
    events were dropped since the previous one); ``clock`` is ``time.monotonic`` unless a test
    injects another.
    """

    def __init__(
        self,
        capacity: int,
        *,
        drop_warning_interval_s: float = DEFAULT_DROP_WARNING_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity <= 0:
            raise ValueError(f"capacity must be an int > 0, got {capacity!r}")
        if (
            isinstance(drop_warning_interval_s, bool)
            or not isinstance(drop_warning_interval_s, int | float)
            or not (drop_warning_interval_s >= 0)
        ):
            raise ValueError(
                f"drop_warning_interval_s must be a number >= 0, got {drop_warning_interval_s!r}"
            )
        self._capacity = capacity
        self._warning_interval = float(drop_warning_interval_s)
        self._clock = clock
        self._cond = threading.Condition(threading.Lock())
        self._events: deque[KVCacheEvent | _Segment] = deque()
        self._count = 0  # events held (a segment holds several)
        self._segments = 0  # segments among self._events
        self._closed = False
        self._high_water_mark = 0
        self._added_total = 0
        self._dropped_total = 0
        self._dropped_by_rank: dict[int, int] = {}
        self._dropped_by_window: dict[int, int] = {}
        self._undrained_drops: dict[int, int] = {}
        self._marks: deque[list[int]] = deque()
        """[older, rank, count]: drops recorded while ``older`` events were buffered, oldest first.
        They join ``_undrained_drops`` once those events are taken or dropped, so that a drain
        never reports a drop together with events older than it (a consumer applies a batch's
        drops before its events)."""
        self._last_warning_at: float | None = None
        self._dropped_since_warning = 0
        self._drop_listeners: list[DropListener] = []

    @property
    def capacity(self) -> int:
        """The most events the buffer holds."""
        return self._capacity

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._closed

    def __len__(self) -> int:
        return self._count

    def add_drop_listener(self, listener: DropListener) -> None:
        """Call ``listener(source_rank, dropped_events, newest_dropped_event_id)`` after every
        drop, outside the buffer's lock, in the thread that dropped (the manager's worker, the
        gather): it must be quick and must not block."""
        if not callable(listener):
            raise TypeError(f"listener must be callable, got {listener!r}")
        self._drop_listeners.append(listener)

    def _notify_drops(self, drops: dict[int, tuple[int, int | None]]) -> None:
        for listener in self._drop_listeners:
            for rank, (count, newest) in drops.items():
                try:
                    listener(rank, count, newest)
                except Exception:  # a listener's bug must not lose the events being added
                    log.exception("drop listener %r failed", listener)

    # -- adding ---------------------------------------------------------------------------

    def extend(self, events: Sequence[KVCacheEvent]) -> int:
        """Append ``events`` (oldest first), dropping the oldest events beyond the capacity:
        first from the buffer, then from the front of ``events``. Returns how many were dropped.

        Each dropped event is counted under its own ``attention_dp_rank`` (0 when None) and
        ``window_size``. Wakes waiting readers.
        """
        return self._extend(events, None)

    def extend_encoded(self, events: EncodedEvents, windows: array[int]) -> int:
        """:meth:`extend` for events still Avro-encoded (another rank's, as the gather received
        them; ``windows`` their window sizes): kept as bytes, handed to the Kafka sink as such
        by :meth:`drain_encoded`; :meth:`take` and :meth:`drain` decode them."""
        if len(windows) != len(events):
            raise ValueError(f"{len(events)} events with {len(windows)} window sizes")
        return self._extend(events, windows)

    def _extend(self, events: Sequence[KVCacheEvent], windows: array[int] | None) -> int:
        count = len(events)
        if count == 0:
            return 0
        warning = None
        notify: dict[int, tuple[int, int | None]] = {}
        with self._cond:
            buffered = self._events
            overflow = self._count + count - self._capacity
            dropped_now = from_batch = 0
            if overflow > 0:
                from_buffer = min(self._count, overflow)
                by_key: dict[tuple[int | None, int], int] = {}
                newest: dict[int, int] = {}
                popleft = buffered.popleft
                left = from_buffer
                while left:
                    item = buffered[0]
                    if item.__class__ is _Segment:
                        n = len(item.events)
                        item.drop_front(min(n, left), by_key, newest)
                        if n <= left:
                            popleft()
                            self._segments -= 1
                        left -= min(n, left)
                        continue
                    event = popleft()
                    key = (event.attention_dp_rank, event.window_size)  # type: ignore[union-attr]
                    by_key[key] = by_key.get(key, 0) + 1
                    newest[_rank_key(event.attention_dp_rank)] = event.event_id  # type: ignore[union-attr]
                    left -= 1
                self._count -= from_buffer
                self._release_marks_locked(from_buffer)
                from_batch = overflow - from_buffer
                if from_batch:
                    if windows is not None:
                        segment = _Segment(events, windows)  # type: ignore[arg-type]
                        segment.drop_front(from_batch, by_key, newest)
                        events, windows = segment.events, segment.windows
                    else:
                        for event in events[:from_batch]:
                            key = (event.attention_dp_rank, event.window_size)
                            by_key[key] = by_key.get(key, 0) + 1
                            newest[_rank_key(event.attention_dp_rank)] = event.event_id
                        events = events[from_batch:]
                for (rank, window_size), n in by_key.items():
                    self._count_drops_locked(_rank_key(rank), n, window_size)
                    old_count, _ = notify.get(_rank_key(rank), (0, None))
                    notify[_rank_key(rank)] = (old_count + n, newest.get(_rank_key(rank)))
                dropped_now = overflow
                warning = self._warning_locked()
            if windows is not None:
                if len(events):
                    buffered.append(_Segment(events, windows))  # type: ignore[arg-type]
                    self._segments += 1
            else:
                buffered.extend(events)
            self._count += count - from_batch
            self._added_total += count
            if self._count > self._high_water_mark:
                self._high_water_mark = self._count
            self._cond.notify_all()
        if warning is not None:
            log.warning(*warning)
        if notify and self._drop_listeners:
            self._notify_drops(notify)
        return dropped_now

    def record_drops(
        self,
        source_rank: int,
        dropped_events: int,
        *,
        window_size: int | None = None,
        newest_event_id: int | None = None,
        notify: bool = True,
    ) -> None:
        """Count ``dropped_events`` events of ``source_rank`` lost outside this buffer: drops an
        attention-DP rank reported for its own buffer (rank 0's gather), or events the manager's
        worker skipped because they would be dropped anyway (with their ``window_size`` and the
        id of the newest of them). They join the per-rank counts, the total, the next
        :meth:`drain`, the warning and (unless ``notify`` is False: the source rank knows
        already) the drop listeners.
        """
        if isinstance(source_rank, bool) or not isinstance(source_rank, int) or source_rank < 0:
            raise ValueError(f"source_rank must be an int >= 0, got {source_rank!r}")
        if isinstance(dropped_events, bool) or not isinstance(dropped_events, int) or dropped_events < 0:
            raise ValueError(f"dropped_events must be an int >= 0, got {dropped_events!r}")
        if dropped_events == 0:
            return
        with self._cond:
            self._count_drops_locked(source_rank, dropped_events, window_size, undrained=not self._count)
            if self._count:  # after the events buffered now: a drain stops before it
                self._marks.append([self._count, source_rank, dropped_events])
            warning = self._warning_locked()
            self._cond.notify_all()
        if warning is not None:
            log.warning(*warning)
        if notify and self._drop_listeners:
            self._notify_drops({source_rank: (dropped_events, newest_event_id)})

    def _count_drops_locked(
        self, rank: int, count: int, window_size: int | None, *, undrained: bool = True
    ) -> None:
        self._dropped_total += count
        self._dropped_since_warning += count
        self._dropped_by_rank[rank] = self._dropped_by_rank.get(rank, 0) + count
        if undrained:
            self._undrained_drops[rank] = self._undrained_drops.get(rank, 0) + count
        if window_size is not None:
            self._dropped_by_window[window_size] = self._dropped_by_window.get(window_size, 0) + count

    def _warning_locked(self) -> tuple[object, ...] | None:
        now = self._clock()
        if self._last_warning_at is not None and now - self._last_warning_at < self._warning_interval:
            return None
        self._last_warning_at = now
        dropped, self._dropped_since_warning = self._dropped_since_warning, 0
        return (
            "The event queue has reached the max size of %d. %d events have been discarded since the "
            "previous warning (%d in total).",
            self._capacity,
            dropped,
            self._dropped_total,
        )

    # -- taking ---------------------------------------------------------------------------

    def take(self, timeout: float | None = None) -> list[KVCacheEvent]:
        """Wait until events are buffered or the buffer is closed (at most ``timeout`` seconds;
        ``None`` waits forever), then return all buffered events, oldest first, and clear the
        buffer. Returns ``[]`` when the timeout passes first. The C++ ``getEvents``."""
        timeout = check_timeout(timeout)
        with self._cond:
            if not self._events and not self._closed:
                self._cond.wait_for(lambda: bool(self._events) or self._closed, timeout)
            return _as_objects(*self._pop_front_locked(self._count))

    def drain(self, timeout: float | None = None, *, whole: bool = False) -> EventDrain:
        """Like :meth:`take`, and atomically also take the per-rank drop counts accumulated since
        the previous drain; also returns when only drops are pending. ``timeout=0`` never waits.
        Drops recorded (:meth:`record_drops`) while older events were buffered are not reported
        with those events: the drain stops before the drop's place (``more`` says so), and the
        next one starts with it. ``whole``: take everything at once, drops first (a last
        message that cannot wait)."""
        items, encoded, dropped, more = self._drain_front(timeout, whole)
        return EventDrain(_as_objects(items, encoded), dropped, more)

    def drain_encoded(self, timeout: float | None = None) -> EventDrain | EncodedDrain:
        """:meth:`drain` for the Kafka sink (its ``drain_encoded`` seam): when the drained events
        include some still encoded (:meth:`extend_encoded`), every one comes as Avro bytes in
        one ``EncodedEvents``, in buffer order (this rank's own events encoded here, the others'
        bytes as they came); otherwise an :class:`EventDrain` of objects, as :meth:`drain`."""
        items, encoded, dropped, more = self._drain_front(timeout, False)
        if not encoded:
            return EventDrain(items, dropped, more)  # type: ignore[arg-type]  # objects only
        from .sink_encoded import EncodedDrain, EncodedEvents, encode_events

        out = EncodedEvents()
        run: list[KVCacheEvent] = []
        for item in items:
            if isinstance(item, _Segment):
                if run:
                    encode_events(run, out)
                    run = []
                out.extend(item.events)
            else:
                run.append(item)
        if run:
            encode_events(run, out)
        return EncodedDrain(out, dropped, more)

    def _drain_front(
        self, timeout: float | None, whole: bool
    ) -> tuple[list[KVCacheEvent | _Segment], bool, list[RankDrops], bool]:
        """A drain's share of the buffer: (items, whether a segment is among them, the drops
        that precede them, whether a drop mark held events or drops back)."""
        timeout = check_timeout(timeout)
        with self._cond:
            if not self._events and not self._undrained_drops and not self._closed:
                self._cond.wait_for(
                    lambda: bool(self._events or self._undrained_drops) or self._closed, timeout
                )
            if whole:
                self._release_marks_locked(self._count)
            drops = self._undrained_drops  # before the events: taking them may release the next
            self._undrained_drops = {}
            items, encoded = self._pop_front_locked(self._until_mark_locked())
            more = bool(self._count or self._undrained_drops)
        return items, encoded, [RankDrops(rank, drops[rank]) for rank in sorted(drops)], more

    def _pop_front_locked(self, n: int) -> tuple[list[KVCacheEvent | _Segment], bool]:
        """The items holding the oldest ``n`` events (a segment cut where needed), removed, and
        whether a segment is among them."""
        items = self._events
        if n == self._count:  # everything (the usual case)
            taken = list(items)
            encoded = self._segments > 0
            items.clear()
            self._count = self._segments = 0
            self._release_marks_locked(n)
            return taken, encoded
        taken = []
        encoded = False
        left = n
        while left:
            item = items[0]
            if isinstance(item, _Segment):
                encoded = True
                size = len(item.events)
                if size > left:
                    taken.append(_Segment(item.events[:left], item.windows[:left]))
                    item.events, item.windows = item.events[left:], item.windows[left:]
                    break
                self._segments -= 1
                left -= size
            else:
                left -= 1
            taken.append(items.popleft())
        self._count -= n
        self._release_marks_locked(n)
        return taken, encoded

    def _until_mark_locked(self) -> int:
        """How many events a drain takes: all, or those older than the first pending drops."""
        return self._marks[0][0] if self._marks else self._count

    def _release_marks_locked(self, gone: int) -> None:
        """``gone`` of the oldest events left the buffer: drops no older event is left before
        join the next drain."""
        if not gone or not self._marks:
            return
        for mark in self._marks:
            mark[0] -= gone
        while self._marks and self._marks[0][0] <= 0:
            _, rank, count = self._marks.popleft()
            self._undrained_drops[rank] = self._undrained_drops.get(rank, 0) + count

    # -- lifecycle and counters ------------------------------------------------------------

    def close(self) -> None:
        """Wake every waiting reader; later waits return at once. Events stay readable.
        Logs drops not yet reported by a warning. Idempotent."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            unreported = self._dropped_since_warning
            self._dropped_since_warning = 0
            self._cond.notify_all()
        if unreported:
            log.warning(
                "Event buffer closed: %d events discarded since the previous warning (%d in total).",
                unreported,
                self._dropped_total,
            )

    def stats(self) -> BufferStats:
        """A consistent snapshot of the buffer's counters."""
        with self._cond:
            return BufferStats(
                capacity=self._capacity,
                buffered_events=self._count,
                buffer_high_water_mark=self._high_water_mark,
                events_added_total=self._added_total,
                events_dropped_total=self._dropped_total,
                events_dropped_by_rank=dict(self._dropped_by_rank),
                events_dropped_by_window_size=dict(self._dropped_by_window),
            )
