"""kvevents.consumer: the reader side (Kafka reader, global cache index, checkpoints)."""

from .dead_letter import MalformedMessage
from .index import CacheIndex, IndexStats, Match
from .reader import DEFAULT_CONSUMER_CONFIG, EventReader, ReaderError
from .reader_metrics import PartitionState, ReaderMetrics, ReaderProgress, ReadResult, Throughput
from .workers import BlockEntry, WindowStats, WorkerKey, WorkerStats

__all__ = [
    "DEFAULT_CONSUMER_CONFIG",
    "BlockEntry",
    "CacheIndex",
    "EventReader",
    "IndexStats",
    "MalformedMessage",
    "Match",
    "PartitionState",
    "ReadResult",
    "ReaderError",
    "ReaderMetrics",
    "ReaderProgress",
    "Throughput",
    "WindowStats",
    "WorkerKey",
    "WorkerStats",
]
