"""kvevents.consumer: the reader side (Kafka reader, global cache index, checkpoints)."""

from .checkpoint import Checkpoint, CheckpointError, Restored, load_checkpoint, restore, save_checkpoint
from .checkpoint_kafka import KafkaCheckpointStore, SavedCheckpoint
from .dead_letter import MalformedMessage
from .index import CacheIndex, IndexStats, Match
from .reader import DEFAULT_CONSUMER_CONFIG, EventReader, ReaderError
from .reader_metrics import PartitionState, ReaderMetrics, ReaderProgress, ReadResult, Throughput
from .workers import BlockEntry, WindowStats, WorkerKey, WorkerStats

__all__ = [
    "DEFAULT_CONSUMER_CONFIG",
    "BlockEntry",
    "CacheIndex",
    "Checkpoint",
    "CheckpointError",
    "EventReader",
    "IndexStats",
    "KafkaCheckpointStore",
    "MalformedMessage",
    "Match",
    "PartitionState",
    "ReadResult",
    "ReaderError",
    "ReaderMetrics",
    "ReaderProgress",
    "Restored",
    "SavedCheckpoint",
    "Throughput",
    "WindowStats",
    "WorkerKey",
    "WorkerStats",
    "load_checkpoint",
    "restore",
    "save_checkpoint",
]
