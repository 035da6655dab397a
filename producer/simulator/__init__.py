"""kvevents.producer.simulator: a simulated engine driving real ``KVCacheEventManager`` objects.

``cache`` (paged block cache), ``workload`` (seeded requests), ``engine`` (the engine loop and its
ground truth), ``run`` (the ``mpiexec`` runner behind ``kvevents simulate``). Not production code:
it feeds the demo, the tests and the benchmarks.
"""

from .engine import (
    CountingEventManager,
    EngineSimulator,
    EventManagerLike,
    GroundTruth,
    IterationReport,
    SimulatorConfig,
    SimulatorStats,
    held_prefix_length,
)

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
