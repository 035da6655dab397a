"""kvevents.producer: the engine side (per-rank event manager, MPI gather, Kafka sink)."""

from ._mpi import find_mpiexec
from .block import BlockInfo
from .buffer import EventBuffer, EventDrain
from .gather import AttentionDpGather, GatherConfig, GatherStats, tolerate_peer_failures
from .manager import KVCacheEventManager
from .metrics import MetricFamily, ProducerMetrics, Sample
from .sink import KafkaEventSink
from .sink_config import DEFAULT_PRODUCER_CONFIG
from .sink_stats import DeliveryReport, LatencySnapshot, SinkCloseReport, SinkStats
from .snapshot import SnapshotSummary, snapshot_chains
from .stats import BufferStats, ManagerStats

__all__ = [
    "DEFAULT_PRODUCER_CONFIG",
    "AttentionDpGather",
    "BlockInfo",
    "BufferStats",
    "DeliveryReport",
    "EventBuffer",
    "EventDrain",
    "GatherConfig",
    "GatherStats",
    "KVCacheEventManager",
    "KafkaEventSink",
    "LatencySnapshot",
    "ManagerStats",
    "MetricFamily",
    "ProducerMetrics",
    "Sample",
    "SinkCloseReport",
    "SinkStats",
    "SnapshotSummary",
    "find_mpiexec",
    "snapshot_chains",
    "tolerate_peer_failures",
]
