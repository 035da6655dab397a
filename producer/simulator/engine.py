"""A simulated inference engine rank that drives a ``KVCacheEventManager`` as a real one does.

Per iteration :meth:`EngineSimulator.step` admits arrived requests (reusing cached prefixes),
decodes, stores and releases finished requests' blocks, publishes a snapshot when asked, and
flushes the manager once. :meth:`EngineSimulator.ground_truth` is the exact set of blocks the
caches hold between iterations. The loop in detail: ``docs/SIMULATOR.md``.
"""

from __future__ import annotations

import heapq
import time
from collections import deque
from collections.abc import Callable, Container, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Protocol

from .cache import (
    DEFAULT_OFFLOAD_MIN_PRIORITY,
    DEFAULT_WINDOW_SIZE,
    CacheStats,
    HeldBlock,
    KVEventSink,
    PagedBlockCache,
    block_hashes,
    to_token_array,
)
from .workload import Request, WorkloadGenerator

__all__ = [
    "CountingEventManager",
    "EngineSimulator",
    "EventManagerLike",
    "GroundTruth",
    "IterationReport",
    "SimulatorConfig",
    "SimulatorStats",
    "held_prefix_length",
]


class EventManagerLike(KVEventSink, Protocol):
    """What the simulator calls on a ``KVCacheEventManager``: the ``enqueue_*`` methods and ``flush``."""

    def flush(self) -> None: ...


class CountingEventManager:
    """An event manager that only counts what it is given (runs without Kafka, benchmarks)."""

    def __init__(self) -> None:
        self.created_events = 0
        self.stored_events = 0
        self.stored_blocks = 0
        self.removed_calls = 0
        self.updated_events = 0
        self.flushes = 0

    @property
    def calls(self) -> int:
        """Every ``enqueue_*`` call (consecutive Removed calls are not merged here)."""
        return self.created_events + self.stored_events + self.removed_calls + self.updated_events

    def enqueue_created_event(self, num_blocks_per_cache_level: list[int], window_size: int) -> None:
        self.created_events += 1

    def enqueue_stored_event(self, blocks: list[Any], window_size: int) -> None:
        self.stored_events += 1
        self.stored_blocks += len(blocks)

    def enqueue_removed_event(self, block_hash: int, window_size: int) -> None:
        self.removed_calls += 1

    def enqueue_updated_event(self, data: Any, window_size: int) -> None:
        self.updated_events += 1

    def flush(self) -> None:
        self.flushes += 1


def held_prefix_length(hashes: Iterable[int], held: Container[int]) -> int:
    """How many leading hashes of a block chain ``held`` contains (a worker's true prefix hit)."""
    count = 0
    for h in hashes:
        if h not in held:
            break
        count += 1
    return count


@dataclass(frozen=True)
class SimulatorConfig:
    """One simulated engine rank: its identity, its caches and its pace."""

    instance_id: str = "sim-0"
    attention_dp_rank: int | None = None
    block_size: int = 32
    """Tokens per block."""
    num_primary_blocks: int = 1024
    """Primary (GPU) capacity in blocks, per window size."""
    num_secondary_blocks: int = 0
    """Secondary (host) capacity in blocks, per window size; 0 disables offloading."""
    window_sizes: tuple[int, ...] = (DEFAULT_WINDOW_SIZE,)
    """One cache per attention window size (TensorRT-LLM's VSWA); one by default."""
    offload_min_priority: int = DEFAULT_OFFLOAD_MIN_PRIORITY
    iterations_per_second: float = 100.0
    """Simulated iterations per simulated second (the simulated clock's step)."""
    realtime: bool = False
    """Sleep so that iterations also keep that pace on the wall clock."""
    pace_slack_s: float = 0.001
    """With ``realtime``: sleep only once the loop is this far ahead of its schedule (then back
    to it), so iterations run up to this much early, a few at a time, never late. A sleep costs
    a context switch (~25 us of CPU on this machine, more than an idle iteration): at 6,400
    iterations/s one per iteration was most of a simulated rank's CPU. 0: sleep whenever ahead
    (every iteration). Iterations slower than this are each still paced one by one; the events
    are the same either way, only their flush times move."""
    max_batch_size: int = 64
    """Most requests running at once."""
    max_waiting_requests: int = 10_000
    """Most requests waiting for admission; later arrivals are rejected (and counted)."""
    decode_tokens_per_iteration: int = 1
    snapshot_on_request: bool = False
    """Publish a snapshot at the end of an iteration whenever the event manager's
    ``snapshot_requested`` is set (it lost events of this rank), as an engine should."""

    def __post_init__(self) -> None:
        if not self.window_sizes or len(set(self.window_sizes)) != len(self.window_sizes):
            raise ValueError(f"window_sizes must be distinct and non-empty, got {self.window_sizes!r}")
        if not self.iterations_per_second > 0:
            raise ValueError(f"iterations_per_second must be > 0, got {self.iterations_per_second}")
        if not self.pace_slack_s >= 0:
            raise ValueError(f"pace_slack_s must be >= 0, got {self.pace_slack_s}")
        for name in (
            "max_batch_size",
            "max_waiting_requests",
            "decode_tokens_per_iteration",
            "block_size",
            "num_primary_blocks",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.attention_dp_rank is not None and self.attention_dp_rank < 0:
            raise ValueError(f"attention_dp_rank must be >= 0 or None, got {self.attention_dp_rank}")


@dataclass
class SimulatorStats:
    """What one simulator did. Hits are counted on the first window size; events over all."""

    iterations: int = 0
    simulated_seconds: float = 0.0
    requests_arrived: int = 0
    requests_admitted: int = 0
    requests_served: int = 0
    requests_rejected: int = 0
    """Requests dropped, and counted here: larger than a whole cache, or arriving at a full
    waiting queue (``max_waiting_requests``)."""
    requests_waiting: int = 0
    requests_running: int = 0
    prompt_tokens: int = 0
    matchable_blocks: int = 0
    hit_blocks: int = 0
    hit_tokens: int = 0
    created_events: int = 0
    stored_events: int = 0
    stored_blocks: int = 0
    removed_blocks: int = 0
    updated_events: int = 0
    evictions: int = 0
    offloads: int = 0
    onboards: int = 0
    priority_updates: int = 0
    snapshots: int = 0
    """Snapshots published (:meth:`EngineSimulator.publish_snapshot`)."""

    @property
    def hit_rate(self) -> float:
        """Prefix-cache hit rate: reused blocks / reusable full prompt blocks."""
        return self.hit_blocks / self.matchable_blocks if self.matchable_blocks else 0.0

    @property
    def events_enqueued(self) -> int:
        """``enqueue_*`` calls (a real manager merges consecutive Removed calls into fewer events)."""
        return self.created_events + self.stored_events + self.removed_blocks + self.updated_events

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["hit_rate"] = self.hit_rate
        data["events_enqueued"] = self.events_enqueued
        return data


@dataclass(frozen=True)
class IterationReport:
    """What one :meth:`EngineSimulator.step` did."""

    iteration: int
    admitted: int
    finished: int
    hit_blocks: int


@dataclass(frozen=True)
class GroundTruth:
    """What one worker's caches hold, per window size, at one moment (between iterations)."""

    instance_id: str
    attention_dp_rank: int | None
    block_size: int
    iteration: int
    num_blocks_per_cache_level: dict[int, list[int]]
    windows: dict[int, dict[int, HeldBlock]]
    """window size → block hash → the held block."""

    @property
    def worker(self) -> tuple[str, int | None]:
        """(instance_id, attention_dp_rank): the consumer's ``WorkerKey`` fields."""
        return (self.instance_id, self.attention_dp_rank)

    def _window(self, window_size: int | None) -> dict[int, HeldBlock]:
        if window_size is None:
            window_size = next(iter(self.windows))
        try:
            return self.windows[window_size]
        except KeyError:
            raise KeyError(f"no window size {window_size} (have {sorted(self.windows)})") from None

    def levels(self, window_size: int | None = None) -> dict[int, tuple[int, int]]:
        """block hash → (cache level, priority) for one window size (the first by default)."""
        return {h: (b.cache_level, b.priority) for h, b in self._window(window_size).items()}

    def prefix_hit_blocks(
        self, tokens: Sequence[int], lora_id: int | None = None, window_size: int | None = None
    ) -> int:
        """How many leading full blocks of ``tokens`` this worker held (the true prefix hit)."""
        return held_prefix_length(block_hashes(tokens, self.block_size, lora_id), self._window(window_size))

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict; blocks sorted by hash, window sizes as string keys."""
        return {
            "instance_id": self.instance_id,
            "attention_dp_rank": self.attention_dp_rank,
            "block_size": self.block_size,
            "iteration": self.iteration,
            "num_blocks_per_cache_level": {str(w): v for w, v in self.num_blocks_per_cache_level.items()},
            "windows": {
                str(w): [blocks[h].to_json() for h in sorted(blocks)] for w, blocks in self.windows.items()
            },
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> GroundTruth:
        """The inverse of :meth:`to_json`."""
        return cls(
            instance_id=data["instance_id"],
            attention_dp_rank=data["attention_dp_rank"],
            block_size=int(data["block_size"]),
            iteration=int(data["iteration"]),
            num_blocks_per_cache_level={
                int(w): list(v) for w, v in data["num_blocks_per_cache_level"].items()
            },
            windows={
                int(w): {int(b["block_hash"]): HeldBlock.from_json(b) for b in blocks}
                for w, blocks in data["windows"].items()
            },
        )


@dataclass
class _Waiting:
    request: Request
    hashes: list[int] | None = None


class EngineSimulator:
    """One simulated engine rank: caches per window size, a scheduler, and its event manager.

    ``events`` is the rank's ``KVCacheEventManager`` (or any :class:`EventManagerLike`; None for
    no events). ``workload`` supplies requests by arrival time (a :class:`WorkloadGenerator` or
    any iterable of :class:`Request` with non-decreasing ``arrival_time``); without one the
    simulator only serves what :meth:`submit` hands it. ``block_info`` builds the objects given
    to ``enqueue_stored_event`` (the producer's ``BlockInfo`` by default).
    """

    def __init__(
        self,
        config: SimulatorConfig | None = None,
        events: EventManagerLike | None = None,
        workload: WorkloadGenerator | Iterable[Request] | None = None,
        *,
        block_info: Callable[..., Any] | None = None,
    ) -> None:
        self.config = cfg = config or SimulatorConfig()
        self.events = events
        self.caches: dict[int, PagedBlockCache] = {
            w: PagedBlockCache(
                block_size=cfg.block_size,
                num_primary_blocks=cfg.num_primary_blocks,
                num_secondary_blocks=cfg.num_secondary_blocks,
                window_size=w,
                events=events,
                offload_min_priority=cfg.offload_min_priority,
                block_info=block_info,
            )
            for w in cfg.window_sizes
        }
        self._first_cache = self.caches[cfg.window_sizes[0]]
        self._source: Iterator[Request] | None = None if workload is None else iter(workload)
        self._endless = isinstance(workload, WorkloadGenerator)
        self._pending: Request | None = None
        self._arrivals_open = self._source is not None
        self._max_arrivals: int | None = None
        self._waiting: deque[_Waiting] = deque()
        self._running: dict[int, Request] = {}
        self._finish_heap: list[tuple[int, int]] = []
        self._next_seq = 0
        self._started = False
        self._stop_requested = False
        self.iteration = 0
        self._stats = SimulatorStats()

    # ------------------------------------------------------------------ clock and state

    @property
    def now(self) -> float:
        """Simulated seconds at the start of the next iteration."""
        return self.iteration / self.config.iterations_per_second

    @property
    def worker(self) -> tuple[str, int | None]:
        return (self.config.instance_id, self.config.attention_dp_rank)

    @property
    def idle(self) -> bool:
        """Nothing waiting, nothing running."""
        return not self._waiting and not self._running

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        return len(self._running)

    def request_stop(self) -> None:
        """Make :meth:`run` return after the current iteration (safe from a signal handler)."""
        self._stop_requested = True

    # ------------------------------------------------------------------ engine

    def start(self) -> None:
        """Emit the Created event of every window size (done by the first :meth:`step`)."""
        if self._started:
            return
        self._started = True
        for cache in self.caches.values():
            cache.emit_created()

    def submit(self, request: Request) -> bool:
        """Queue a request for admission at the next iteration (a router handing it over).

        Returns False, and counts the request as rejected, when the waiting queue is full.
        """
        self._stats.requests_arrived += 1
        if len(self._waiting) >= self.config.max_waiting_requests:
            self._stats.requests_rejected += 1
            return False
        self._waiting.append(_Waiting(request))
        return True

    def close_arrivals(self) -> None:
        """Take no more requests from the workload (running and waiting ones still finish)."""
        self._arrivals_open = False

    def _take_arrivals(self, now: float) -> None:
        source = self._source
        if source is None or not self._arrivals_open:
            return
        while True:
            if self._max_arrivals is not None and self._stats.requests_arrived >= self._max_arrivals:
                self._arrivals_open = False
                return
            if self._pending is None:
                self._pending = next(source, None)
                if self._pending is None:
                    self._arrivals_open = False
                    return
            if self._pending.arrival_time > now:
                return
            self.submit(self._pending)
            self._pending = None

    def _fits_at_all(self, request: Request) -> bool:
        needed = self._first_cache.blocks_needed(len(request.prompt), request.max_new_tokens)
        return (
            len(request.prompt) > 0
            and request.max_new_tokens > 0
            and needed <= self.config.num_primary_blocks
        )

    def _admit(self, waiting: _Waiting) -> int:
        request = waiting.request
        seq_id = self._next_seq
        self._next_seq += 1
        hits = 0
        for cache in self.caches.values():
            h = cache.add_sequence(
                seq_id,
                request.prompt,
                request.max_new_tokens,
                request.lora_id,
                retention=request.retention,
                hashes=waiting.hashes,
            )
            if cache is self._first_cache:
                hits = h
            cache.store_blocks(seq_id, request.prompt)  # the context phase computed the prompt's KV
        self._running[seq_id] = request
        remaining = request.max_new_tokens - 1  # the context phase produced the first token
        tpi = self.config.decode_tokens_per_iteration
        heapq.heappush(self._finish_heap, (self.iteration + -(-remaining // tpi), seq_id))
        stats = self._stats
        stats.requests_admitted += 1
        stats.prompt_tokens += len(request.prompt)
        return hits

    def _finish(self, seq_id: int) -> None:
        request = self._running.pop(seq_id)
        sequence = request.prompt + request.output
        del sequence[-1:]  # the last generated token's KV state is never computed
        for cache in self.caches.values():
            cache.store_blocks(seq_id, sequence)
            cache.release(seq_id)
        self._stats.requests_served += 1

    def step(self) -> IterationReport:
        """Run one engine iteration and flush its events."""
        iteration = self.iteration
        admitted, finished, hits = self._step()
        return IterationReport(iteration, admitted, finished, hits)

    def _step(self) -> tuple[int, int, int]:
        """:meth:`step` without its report (a frozen dataclass per iteration: :meth:`run`'s
        loop does not need it); returns (admitted, finished, hit blocks)."""
        if not self._started:
            self.start()
        cfg = self.config
        self._take_arrivals(self.now)
        admitted = hits = 0
        caches = self.caches.values()
        while self._waiting and len(self._running) < cfg.max_batch_size:
            waiting = self._waiting[0]
            request = waiting.request
            if not self._fits_at_all(request):
                self._waiting.popleft()
                self._stats.requests_rejected += 1
                continue
            if waiting.hashes is None:
                limit = (len(request.prompt) - 1) // cfg.block_size
                waiting.hashes = block_hashes(
                    request.prompt, cfg.block_size, request.lora_id, max_blocks=limit
                )
            if not all(
                c.can_admit(request.prompt, request.max_new_tokens, request.lora_id, hashes=waiting.hashes)
                for c in caches
            ):
                break  # FIFO: the head waits for running requests to free blocks
            self._waiting.popleft()
            hits += self._admit(waiting)
            admitted += 1
        finished = 0
        heap = self._finish_heap
        while heap and heap[0][0] <= self.iteration:
            self._finish(heapq.heappop(heap)[1])
            finished += 1
        if cfg.snapshot_on_request and getattr(self.events, "snapshot_requested", False):
            self.publish_snapshot()
        if self.events is not None:
            self.events.flush()
        self.iteration += 1
        return admitted, finished, hits

    def run(
        self,
        *,
        duration_s: float | None = None,
        max_requests: int | None = None,
        drain: bool = False,
        should_stop: Callable[[], bool] | None = None,
        max_iterations: int | None = None,
    ) -> SimulatorStats:
        """Iterate until ``duration_s`` simulated seconds have passed, ``max_requests`` more
        requests have arrived (the workload is then closed for good), ``max_iterations`` ran,
        the workload is exhausted, or a stop is requested; with ``drain``, then keep iterating
        (taking no new arrivals) until every admitted and waiting request finished. Returns
        :meth:`stats`.
        """
        unbounded = (
            duration_s is None and max_requests is None and max_iterations is None and should_stop is None
        )
        if unbounded and self._endless:
            raise ValueError(
                "run() over an endless workload needs duration_s, max_requests, max_iterations or should_stop"
            )
        if max_requests is not None:
            self._max_arrivals = self._stats.requests_arrived + max_requests
        cfg = self.config
        end_iteration = (
            None if duration_s is None else self.iteration + round(duration_s * cfg.iterations_per_second)
        )
        last_iteration = None if max_iterations is None else self.iteration + max_iterations
        wall_start = time.monotonic()
        first_iteration = self.iteration
        self._stop_requested = False
        slack = cfg.pace_slack_s

        def pace() -> None:
            if cfg.realtime:
                target = wall_start + (self.iteration - first_iteration) / cfg.iterations_per_second
                delay = target - time.monotonic()
                if delay > 0 and delay >= slack:
                    time.sleep(delay)

        def stopping() -> bool:
            return self._stop_requested or (should_stop is not None and should_stop())

        while not stopping():
            if end_iteration is not None and self.iteration >= end_iteration:
                break
            if last_iteration is not None and self.iteration >= last_iteration:
                break
            if not self._arrivals_open and self.idle:
                break
            self._step()
            pace()
        if drain:
            self.close_arrivals()
            while not self.idle and not stopping():
                self._step()
                pace()
        return self.stats()

    def publish_snapshot(self) -> Any:
        """Queue a snapshot of every cache (each window's held blocks, levels, priorities and
        capacity) with the event manager's ``enqueue_snapshot``; it goes out with the next
        flush. Returns the manager's ``SnapshotSummary``. Call between iterations."""
        enqueue = getattr(self.events, "enqueue_snapshot", None)
        if enqueue is None:
            raise TypeError(
                f"publishing a snapshot needs an event manager with enqueue_snapshot (a "
                f"KVCacheEventManager), not {type(self.events).__name__}"
            )
        self.start()
        summary = enqueue(
            {w: c.snapshot_blocks() for w, c in self.caches.items()},
            {w: c.num_blocks_per_cache_level for w, c in self.caches.items()},
        )
        self._stats.snapshots += 1
        return summary

    # ------------------------------------------------------------------ queries

    def prefix_hit_blocks(
        self, tokens: Sequence[int], lora_id: int | None = None, window_size: int | None = None
    ) -> int:
        """How many leading full blocks of ``tokens`` this worker holds right now (any level).

        A routing policy's true score for a request. The engine itself reuses at most
        ``(len(prompt) - 1) // block_size`` blocks (the last prompt token is always recomputed);
        :meth:`reusable_blocks` applies that rule.
        """
        cache = self._first_cache if window_size is None else self.caches[window_size]
        return cache.match(tokens, lora_id)

    def reusable_blocks(self, request: Request, window_size: int | None = None) -> int:
        """How many blocks admitting ``request`` now would reuse (its true prefix hit)."""
        prompt = to_token_array(request.prompt)
        return self.prefix_hit_blocks(prompt[:-1], request.lora_id, window_size)

    def ground_truth(self) -> GroundTruth:
        """What the caches hold now, per window size (matches every event flushed so far)."""
        cfg = self.config
        return GroundTruth(
            instance_id=cfg.instance_id,
            attention_dp_rank=cfg.attention_dp_rank,
            block_size=cfg.block_size,
            iteration=self.iteration,
            num_blocks_per_cache_level={w: c.num_blocks_per_cache_level for w, c in self.caches.items()},
            windows={w: c.held_blocks() for w, c in self.caches.items()},
        )

    def cache_stats(self) -> dict[int, CacheStats]:
        """Per window size, the cache's own counters."""
        return {w: c.stats for w, c in self.caches.items()}

    def stats(self) -> SimulatorStats:
        """A snapshot of the counters."""
        s = SimulatorStats(**asdict(self._stats))
        s.iterations = self.iteration
        s.simulated_seconds = self.now
        s.requests_waiting = len(self._waiting)
        s.requests_running = len(self._running)
        first = self._first_cache.stats
        s.matchable_blocks = first.matchable_blocks
        s.hit_blocks = first.hit_blocks
        s.hit_tokens = first.hit_blocks * self.config.block_size
        for c in self.caches.values():
            cs = c.stats
            s.created_events += cs.created_events
            s.stored_events += cs.stored_events
            s.stored_blocks += cs.stored_blocks
            s.removed_blocks += cs.removed_blocks
            s.updated_events += cs.updated_events
            s.evictions += cs.evictions
            s.offloads += cs.offloads
            s.onboards += cs.onboards
            s.priority_updates += cs.priority_updates
        return s

    def check_invariants(self) -> None:
        """Recount every cache from scratch (tests); raises ``AssertionError`` on a mismatch."""
        for cache in self.caches.values():
            cache.check_invariants()
            assert cache.num_running == len(self._running)
