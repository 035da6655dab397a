"""Run simulated engine ranks as real processes: ``kvevents simulate``'s engine room.

Every process is one attention-DP rank of one engine instance: an ``EngineSimulator`` driving a
real ``KVCacheEventManager``, and on each instance's rank 0 a ``KafkaEventSink``. Under
``mpiexec`` the world splits into instances (each gathering over its own communicator); every
rank's :class:`RankResult` reaches world rank 0, which :func:`run` returns them on. The run's
configuration and topology: :mod:`.run_config`; dead ranks and shutdown: ``docs/SIMULATOR.md``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .._mpi import collect_at_root
from ..manager import KVCacheEventManager
from .engine import EngineSimulator
from .run_config import SimRunConfig, Topology, topology
from .shutdown import DeadRankNotice, any_rank, barrier, wait_for_instance
from .workload import WorkloadGenerator

log = logging.getLogger(__name__)

__all__ = ["Progress", "RankResult", "SimRun", "collect_results", "run"]


def lower_this_thread(nice: int) -> None:
    """Lower the calling thread's CPU priority to ``nice`` (Linux: per thread; threads it starts
    later inherit it). A failure is logged, not raised: the run goes on at normal priority."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
    except OSError as exc:
        log.warning("could not set the engine thread's nice to %d: %s", nice, exc)


@dataclass
class RankResult:
    """One rank's outcome: its counters, its instance's Kafka figures (on DP rank 0), its truth."""

    instance_id: str
    attention_dp_rank: int
    attention_dp_size: int
    seconds: float
    requests_arrived: int
    requests_served: int
    iterations: int
    events_enqueued: int
    stored_blocks: int
    removed_blocks: int
    manager_drops: int
    """Events this rank's manager buffer dropped (on rank 0 including other ranks' events)."""
    snapshots: int
    hit_rate: float
    snapshot_failures: int = 0
    """Snapshots that could not be published (larger than the manager's buffer)."""
    interrupted: bool = False
    error: str | None = None
    kafka: dict[str, Any] | None = None
    """On DP rank 0 with a topic: messages/events/bytes delivered, losses, the close report."""
    truth: dict[str, Any] | None = None
    """``GroundTruth.to_json()`` after the last iteration (None if the rank failed early)."""
    dead_ranks: list[int] = field(default_factory=list)
    """On DP rank 0: the instance's ranks its gather declared dead (and that never came back)."""

    @property
    def events_lost_unreported(self) -> int:
        """Losses no delivered batch reported (consumers cannot know): must be 0."""
        if self.kafka is None:
            return 0
        return sum(self.kafka.get("unreported_by_rank", {}).values())

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> RankResult:
        return cls(**data)

    @classmethod
    def failed(cls, topo: Topology, error: str, interrupted: bool = False) -> RankResult:
        """The result of a rank that raised ``error`` before it finished."""
        return cls.missing(
            topo.instance_id, topo.attention_dp_rank, topo.attention_dp_size, error, interrupted
        )

    @classmethod
    def missing(
        cls,
        instance_id: str,
        attention_dp_rank: int,
        attention_dp_size: int,
        error: str,
        interrupted: bool = False,
    ) -> RankResult:
        """The result of a rank that failed or never reported (``error`` says which)."""
        return cls(
            instance_id,
            attention_dp_rank,
            attention_dp_size,
            seconds=0.0,
            requests_arrived=0,
            requests_served=0,
            iterations=0,
            events_enqueued=0,
            stored_blocks=0,
            removed_blocks=0,
            manager_drops=0,
            snapshots=0,
            hit_rate=0.0,
            interrupted=interrupted,
            error=error,
        )


@dataclass(frozen=True)
class Progress:
    """What the leader's progress callback sees (its own instance's rank 0 view)."""

    seconds: float
    requests: int
    events: int
    drops: int
    delivered: int | None


class _TimedFlushes:
    """The manager as the simulator sees it, noting when each flush handed over which event ids."""

    def __init__(self, manager: KVCacheEventManager) -> None:
        self.manager = manager
        self.flushes: list[tuple[int, float]] = []
        self._enqueued = 0
        self._flush = manager.flush
        # The engine's hot calls bound here: through __getattr__ each one cost a failed lookup
        # and a Python call on the engine thread (~24k calls/s per rank at the freshness
        # bench's top step).
        self.enqueue_stored_event = manager.enqueue_stored_event
        self.enqueue_removed_event = manager.enqueue_removed_event
        self.enqueue_updated_event = manager.enqueue_updated_event

    def flush(self) -> None:
        self._flush()
        enqueued = self.manager.next_event_id
        if enqueued != self._enqueued:
            self._enqueued = enqueued
            self.flushes.append((enqueued - 1, time.monotonic()))

    def __getattr__(self, name: str) -> Any:  # enqueue_created_event / _snapshot, snapshot_requested
        return getattr(self.manager, name)


class _Discard:
    """Rank 0's reader without Kafka: takes the events and forgets them (so none are dropped)."""

    def __init__(self, manager: KVCacheEventManager) -> None:
        self.manager = manager
        self.events = 0
        self.thread = threading.Thread(target=self._run, name="kvevents-discard", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.manager.closed or self.manager.buffer.stats().buffered_events:
            self.events += len(self.manager.get_events(timeout=0.1))

    def wait_delivered(self, timeout: float | None = None) -> bool:
        return self.manager.settle(timeout)

    def close(self, timeout: float | None = None) -> None:
        self.thread.join(timeout)


class SimRun:
    """One rank's run: build it, :meth:`execute` it (collective under MPI), or :meth:`stop` it."""

    def __init__(self, config: SimRunConfig, topo: Topology) -> None:
        self.config = config
        self.topo = topo
        self._stop = False
        self.interrupted = False
        self.snapshot_failures = 0
        self._retry_snapshot_at = 0.0
        self.sim: EngineSimulator | None = None

    def stop(self, interrupted: bool = True) -> None:
        """Make the simulator finish its iteration and shut down (safe from a signal handler)."""
        self._stop = True
        self.interrupted = self.interrupted or interrupted
        if self.sim is not None:
            self.sim.request_stop()

    def _manager(self) -> KVCacheEventManager:
        topo, cfg = self.topo, self.config
        if topo.attention_dp_size > 1:
            return KVCacheEventManager(
                cfg.max_kv_event_entries,
                topo.attention_dp_rank,
                topo.attention_dp_size,
                comm=topo.instance_comm,
                gather_config=cfg.gather_config(),
            )
        return KVCacheEventManager(cfg.max_kv_event_entries)

    def execute(
        self, progress: Callable[[Progress], None] | None = None, progress_interval_s: float = 1.0
    ) -> RankResult:
        """Run this rank to the end and return its result (not yet collected)."""
        cfg, topo = self.config, self.topo
        started = time.monotonic()
        manager = self._manager()  # collective over the instance's communicator
        sink: KafkaEventSink | _Discard | None = None
        try:
            if topo.attention_dp_rank == 0 and cfg.topic is not None:
                from ..sink import KafkaEventSink

                codec = None
                if cfg.schema_registry is not None:
                    from kvevents.schemas.registry import RegistryCodec

                    codec = RegistryCodec(cfg.schema_registry, cfg.topic)
                sink = KafkaEventSink(
                    manager, cfg.topic, topo.instance_id, config=cfg.kafka_config, codec=codec
                )
            elif topo.attention_dp_rank == 0:
                sink = _Discard(manager)
            dp_rank = topo.attention_dp_rank if topo.attention_dp_size > 1 else None
            sim_config = dataclasses.replace(
                cfg.simulator,
                instance_id=topo.instance_id,
                attention_dp_rank=dp_rank,
                realtime=cfg.realtime,
                snapshot_on_request=False,  # answered between iterations by should_stop below
            )
            workload = cfg.workload_for(topo.instance_id, dp_rank)
            engine: Any = manager if cfg.flush_log_dir is None else _TimedFlushes(manager)
            self.sim = sim = EngineSimulator(sim_config, engine, WorkloadGenerator(workload))
            if self._stop:
                sim.request_stop()
            deadline = None if cfg.duration_s is None else started + cfg.duration_s
            next_progress = started + progress_interval_s

            def should_stop() -> bool:
                nonlocal next_progress
                now = time.monotonic()
                if progress is not None and now >= next_progress:
                    next_progress = now + progress_interval_s
                    progress(self._progress(now - started, sim, manager, sink))
                wanted = (
                    cfg.snapshot_on_drops and manager.snapshot_requested and now >= self._retry_snapshot_at
                )
                if wanted and not self._publish_snapshot(sim):
                    self._retry_snapshot_at = now + _SNAPSHOT_RETRY_S  # too large: not every iteration
                return self._stop or (deadline is not None and now >= deadline)

            if cfg.engine_nice:
                lower_this_thread(cfg.engine_nice)
            sim.run(max_requests=cfg.requests, should_stop=should_stop)
            if cfg.snapshot_on_drops:
                self._answer_last_loss(sim, manager, sink)
            truth = sim.ground_truth().to_json()
            if isinstance(engine, _TimedFlushes):
                self._write_flush_log(engine.flushes)
        except BaseException:
            manager.close()
            if sink is not None:
                sink.close(cfg.sink_close_timeout_s)
            raise
        if topo.attention_dp_size > 1:  # no rank's gather may stop while another still produces
            wait_for_instance(
                topo.instance_comm, manager, f"{topo.instance_id} rank {topo.attention_dp_rank}"
            )
        manager.close()
        gather = manager.gather
        dead_ranks = (
            list(gather.stats().ranks_dead) if gather is not None and topo.attention_dp_rank == 0 else []
        )
        kafka = None
        if isinstance(sink, _Discard):
            sink.close(cfg.sink_close_timeout_s)
        elif sink is not None:
            report = sink.close(cfg.sink_close_timeout_s)
            s = sink.stats()
            kafka = {
                "messages_delivered": s.messages_delivered_total,
                "messages_failed": s.messages_failed_total,
                "events_delivered": s.events_delivered_total,
                "bytes_delivered": s.bytes_delivered_total,
                "events_delivered_by_rank": {str(k): v for k, v in s.events_delivered_by_rank.items()},
                "events_lost_by_reason": dict(s.events_lost_by_reason),
                "manager_drops_by_rank": {str(k): v for k, v in s.manager_drops_by_rank.items()},
                "drops_reported_by_rank": {str(k): v for k, v in s.drops_reported_by_rank.items()},
                "undelivered_by_rank": {str(k): v for k, v in report.undelivered_by_rank.items()},
                "unreported_by_rank": {str(k): v for k, v in report.unreported_by_rank.items()},
                "delivery_p50_s": s.delivery_latency.recent_p50_s,
                "delivery_p99_s": s.delivery_latency.recent_p99_s,
            }
        stats = sim.stats()
        mstats = manager.stats()
        return RankResult(
            instance_id=topo.instance_id,
            attention_dp_rank=topo.attention_dp_rank,
            attention_dp_size=topo.attention_dp_size,
            seconds=time.monotonic() - started,
            requests_arrived=stats.requests_arrived,
            requests_served=stats.requests_served,
            iterations=stats.iterations,
            events_enqueued=mstats.events_enqueued_total,
            stored_blocks=mstats.stored_blocks_total,
            removed_blocks=mstats.removed_block_hashes_total,
            manager_drops=mstats.events_dropped_total,
            snapshots=stats.snapshots,
            hit_rate=stats.hit_rate,
            snapshot_failures=self.snapshot_failures,
            interrupted=self.interrupted,
            kafka=kafka,
            truth=truth,
            dead_ranks=dead_ranks,
        )

    def _write_flush_log(self, flushes: list[tuple[int, float]]) -> None:
        assert self.config.flush_log_dir is not None
        topo = self.topo
        path = os.path.join(
            self.config.flush_log_dir, f"flush-{topo.instance_id}-{topo.attention_dp_rank}.json"
        )
        with open(path, "w") as f:
            json.dump(
                {
                    "instance_id": topo.instance_id,
                    "attention_dp_rank": topo.attention_dp_rank,
                    "flushes": flushes,
                },
                f,
            )

    def _publish_snapshot(self, sim: EngineSimulator) -> bool:
        """Queue a snapshot of the caches (it goes out with the next flush). A snapshot larger
        than the manager's buffer cannot be published: counted, warned about once, and the
        worker stays degraded for consumers."""
        try:
            sim.publish_snapshot()
        except ValueError as exc:
            self.snapshot_failures += 1
            if self.snapshot_failures == 1:
                log.warning("%s rank %d: %s", self.topo.instance_id, self.topo.attention_dp_rank, exc)
            return False
        return True

    def _answer_last_loss(
        self, sim: EngineSimulator, manager: KVCacheEventManager, sink: Any, rounds: int = 5
    ) -> None:
        """After the last iteration, answer losses noticed late: a loss is known on a rank only
        after its events went through its buffer, rank 0's buffer (which forwards the loss of
        another rank's events to that rank) and rank 0's sink. Each round, the instance's ranks
        wait for all of that (barriers with timeouts on the instance's communicator, never
        blocking forever), publish a snapshot where one is requested, and agree whether anyone
        did (another round) or not (done). Shutdown only: the engine loop never waits on MPI."""
        comm = self.topo.instance_comm if self.topo.attention_dp_size > 1 else None
        label = f"{self.topo.instance_id} rank {self.topo.attention_dp_rank}"
        dead = DeadRankNotice(comm, manager, label) if comm is not None else None
        for _ in range(rounds):
            manager.settle(timeout=10)
            if comm is not None:
                if not barrier(comm, _ROUND_TIMEOUT_S, dead):
                    return
                time.sleep(_GATHER_SETTLE_S)  # the last events sent by each gather, merged at rank 0
            if sink is not None:
                manager.settle(timeout=10)
                sink.wait_delivered(timeout=_ROUND_TIMEOUT_S)  # rank 0's losses known, forwarded
            if comm is not None:
                if not barrier(comm, _ROUND_TIMEOUT_S, dead):
                    return
                time.sleep(_GATHER_SETTLE_S)  # forwarded losses reach their ranks
            published = manager.snapshot_requested and self._publish_snapshot(sim)
            if published:
                manager.flush()
            again = published if comm is None else any_rank(comm, published, _ROUND_TIMEOUT_S, dead)
            if not again:
                return

    @staticmethod
    def _progress(seconds: float, sim: EngineSimulator, manager: KVCacheEventManager, sink: Any) -> Progress:
        m = manager.stats()
        delivered = (
            None if sink is None or isinstance(sink, _Discard) else sink.stats().events_delivered_total
        )
        requests = sim.stats().requests_arrived
        return Progress(seconds, requests, m.buffer.events_added_total, m.events_dropped_total, delivered)


_SNAPSHOT_RETRY_S = 1.0
_ROUND_TIMEOUT_S = 30.0
_GATHER_SETTLE_S = 0.2


def run(
    config: SimRunConfig,
    *,
    topo: Topology | None = None,
    on_start: Callable[[SimRun], None] | None = None,
    progress: Callable[[Progress], None] | None = None,
    progress_interval_s: float = 1.0,
) -> list[RankResult] | None:
    """Run this process's rank and collect every rank's result at world rank 0 (returned there;
    None on the other ranks). ``on_start`` gets the :class:`SimRun` (to install a signal
    handler that stops it); ``progress`` is called on world rank 0 only."""
    topo = topo or topology(config)
    sim_run = SimRun(config, topo)
    if on_start is not None:
        on_start(sim_run)
    try:
        result = sim_run.execute(progress if topo.leader else None, progress_interval_s)
    except Exception as exc:  # report it with the others instead of leaving the world hanging
        if topo.world_comm is None:
            raise
        result = RankResult.failed(topo, f"{type(exc).__name__}: {exc}", sim_run.interrupted)
    if topo.world_comm is None:
        return [result]
    return collect_results(config, topo, result)


_RESULTS_TAG = 7301
_RESULTS_GRACE_S = 30.0


def collect_results(config: SimRunConfig, topo: Topology, result: RankResult) -> list[RankResult] | None:
    """Every rank's result at world rank 0, in world-rank order (None elsewhere). A rank that
    sent none is reported failed: at once when its instance's rank 0 declared it dead, else
    after the sinks' close timeout and a grace period."""
    timeout_s = config.sink_close_timeout_s + _RESULTS_GRACE_S
    ranks = topo.attention_dp_size

    def known_dead(received: dict[int, bytes]) -> set[int]:
        dead: set[int] = set()
        for world_rank, data in received.items():
            if world_rank % ranks == 0:  # an instance's rank 0 reports its dead ranks
                dead.update(world_rank + r for r in json.loads(data).get("dead_ranks", ()))
        return dead

    payload = json.dumps(result.to_json()).encode()
    received = collect_at_root(
        topo.world_comm, payload, tag=_RESULTS_TAG, timeout_s=timeout_s, known_gone=known_dead
    )
    if received is None:
        return None
    dead = known_dead(received)
    results = []
    for world_rank in range(topo.world_size):
        index, dp_rank = divmod(world_rank, ranks)
        if world_rank in received:
            results.append(RankResult.from_json(json.loads(received[world_rank])))
            continue
        why = (
            "declared dead by its instance's attention-DP gather" if world_rank in dead else "sent no result"
        )
        instance_id = f"{config.instance_prefix}-{config.first_instance + index}"
        results.append(RankResult.missing(instance_id, dp_rank, ranks, f"rank lost: {why}"))
    return results
