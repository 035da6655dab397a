"""kvevents.producer: the engine side (per-rank event manager, MPI gather, Kafka sink)."""

from .block import BlockInfo
from .buffer import EventBuffer, EventDrain
from .manager import KVCacheEventManager
from .metrics import MetricFamily, ProducerMetrics, Sample
from .sink import KafkaEventSink
from .sink_config import DEFAULT_PRODUCER_CONFIG
from .sink_stats import DeliveryReport, LatencySnapshot, SinkCloseReport, SinkStats
from .stats import BufferStats, ManagerStats

__all__ = [
    "DEFAULT_PRODUCER_CONFIG",
    "BlockInfo",
    "BufferStats",
    "DeliveryReport",
    "EventBuffer",
    "EventDrain",
    "KVCacheEventManager",
    "KafkaEventSink",
    "LatencySnapshot",
    "ManagerStats",
    "MetricFamily",
    "ProducerMetrics",
    "Sample",
    "SinkCloseReport",
    "SinkStats",
]
