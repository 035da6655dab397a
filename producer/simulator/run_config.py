"""What a simulated run is (:class:`SimRunConfig`) and where this process sits in it
(:class:`Topology`: world rank, instance, attention-DP rank), from ``mpiexec``'s environment.
The run itself: :mod:`.run`; the layout: ``docs/SIMULATOR.md``."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any

from ..gather import GatherConfig
from .engine import SimulatorConfig
from .workload import WorkloadConfig

__all__ = ["SimRunConfig", "Topology", "mpi_world_size", "topology"]

_WORLD_SIZE_ENV = ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MPI_LOCALNRANKS")


def mpi_world_size() -> int:
    """The number of processes ``mpiexec`` started (from its environment; 1 without it)."""
    for name in _WORLD_SIZE_ENV:
        value = os.environ.get(name, "").strip()
        if value.isdigit():
            return int(value)
    return 1


@dataclass(frozen=True)
class SimRunConfig:
    """What ``kvevents simulate`` runs; the topology: ``docs/SIMULATOR.md``."""

    instances: int = 1
    ranks: int | None = None
    """Attention-DP ranks per instance (default: the world size / ``instances``)."""
    instance_prefix: str = "sim"
    first_instance: int = 0
    duration_s: float | None = None
    """Wall-clock seconds to run (None: until ``requests`` arrived, or a stop)."""
    requests: int | None = None
    """Requests per rank (the workload is then closed; running requests are not drained)."""
    realtime: bool = True
    """Keep the simulator's iterations at their pace on the wall clock (False: as fast as it can)."""
    seed: int = 0
    max_kv_event_entries: int = 10_000
    snapshot_on_drops: bool = False
    """Publish a snapshot whenever the manager lost events of its rank (and once more at the
    end if a loss is still unanswered)."""
    topic: str | None = None
    """Kafka topic; None runs without Kafka (rank 0 takes its events and discards them)."""
    kafka_config: dict[str, Any] = field(default_factory=dict)
    schema_registry: dict[str, Any] | None = None
    """Schema registry client settings (``url``, ...): the sink then registers the schema and
    writes Confluent's framing (:class:`~kvevents.schemas.registry.RegistryCodec`)."""
    sink_close_timeout_s: float = 30.0
    rank_timeout_s: float | None = None
    """The gather declares a rank dead after this long without a word from it (default:
    ``GatherConfig.heartbeat_timeout_s``, 5 s)."""
    flush_log_dir: str | None = None
    """Write ``flush-<instance>-<rank>.json`` here: per flush, the last event id handed over
    and the ``time.monotonic()`` of that flush (for end-to-end latency benchmarks)."""
    engine_nice: int = 0
    """Run each rank's engine thread (the simulated engine's own work, not the manager, gather or
    sink threads) at this ``nice`` value; > 0 lets the pipeline's threads and the rest of the
    machine (broker, routers) go first, as if the engines had hosts of their own. Linux sets it
    per thread; 0 leaves the priority alone."""
    simulator: SimulatorConfig = field(default_factory=SimulatorConfig)
    """Cache shape and pace; instance id, rank, realtime and snapshots are set per rank."""
    workload: WorkloadConfig = field(default_factory=WorkloadConfig)
    """Request mix and rate per rank; each rank's stream is ``workload.for_worker(...)``."""

    def __post_init__(self) -> None:
        if self.instances < 1:
            raise ValueError(f"instances must be >= 1, got {self.instances}")
        if self.ranks is not None and self.ranks < 1:
            raise ValueError(f"ranks must be >= 1, got {self.ranks}")
        if self.duration_s is not None and not self.duration_s > 0:
            raise ValueError(f"duration must be > 0 seconds, got {self.duration_s}")
        if self.requests is not None and self.requests < 1:
            raise ValueError(f"requests must be >= 1, got {self.requests}")
        if self.duration_s is None and self.requests is None:
            raise ValueError("give a duration or a request count (the workload is endless)")
        if self.max_kv_event_entries < 1:
            raise ValueError(f"max_kv_event_entries must be >= 1, got {self.max_kv_event_entries}")
        if not self.instance_prefix:
            raise ValueError("instance_prefix must not be empty")
        if not 0 <= self.engine_nice <= 19:
            raise ValueError(f"engine_nice must be 0..19, got {self.engine_nice}")
        self.gather_config()  # a bad rank timeout is a ValueError now, not on the ranks

    def gather_config(self) -> GatherConfig | None:
        """The attention-DP gather's tuning (None: its defaults)."""
        if self.rank_timeout_s is None:
            return None
        if not self.rank_timeout_s > 0:
            raise ValueError(f"rank timeout must be > 0 seconds, got {self.rank_timeout_s}")
        return GatherConfig(
            heartbeat_interval_s=min(0.5, self.rank_timeout_s / 4), heartbeat_timeout_s=self.rank_timeout_s
        )

    def workload_for(self, instance_id: str, attention_dp_rank: int | None) -> WorkloadConfig:
        """The request stream of one worker (``attention_dp_rank`` None without attention DP)."""
        return dataclasses.replace(self.workload, seed=self.seed).for_worker(instance_id, attention_dp_rank)


@dataclass(frozen=True)
class Topology:
    """Where this process sits: its world rank and its instance's id, DP rank and size."""

    world_rank: int
    world_size: int
    instance_index: int
    instance_id: str
    attention_dp_rank: int
    attention_dp_size: int
    world_comm: Any = None
    instance_comm: Any = None

    @property
    def leader(self) -> bool:
        """World rank 0: collects the results and prints progress."""
        return self.world_rank == 0


def topology(config: SimRunConfig) -> Topology:
    """This process's place (imports mpi4py only when ``mpiexec`` started several processes).
    ``ValueError`` when the world does not split into ``instances`` x ``ranks``."""
    size = mpi_world_size()
    ranks = config.ranks
    if size <= 1:
        if config.instances != 1 or (ranks or 1) != 1:
            raise ValueError(
                f"{config.instances} instances x {ranks or 1} ranks need MPI: run under "
                f"'mpiexec -n {config.instances * (ranks or 1)} kvevents simulate ...'"
            )
        instance_id = f"{config.instance_prefix}-{config.first_instance}"
        return Topology(0, 1, 0, instance_id, 0, 1)
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    size = world.Get_size()
    if ranks is None:
        if size % config.instances:
            raise ValueError(f"{size} MPI processes do not split into {config.instances} instances")
        ranks = size // config.instances
    if config.instances * ranks != size:
        raise ValueError(
            f"{config.instances} instances x {ranks} ranks need {config.instances * ranks} MPI processes, "
            f"mpiexec started {size}"
        )
    world_rank = world.Get_rank()
    index, dp_rank = divmod(world_rank, ranks)
    comm = world.Split(index, world_rank)
    instance_id = f"{config.instance_prefix}-{config.first_instance + index}"
    return Topology(world_rank, size, index, instance_id, dp_rank, ranks, world, comm)
