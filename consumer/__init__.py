"""kvevents.consumer: the reader side (Kafka reader, global cache index, checkpoints, the live
index a router embeds, worker liveness)."""

from .checkpoint import Checkpoint, CheckpointError, Restored, load_checkpoint, restore, save_checkpoint
from .checkpoint_kafka import KafkaCheckpointStore, SavedCheckpoint
from .dead_letter import MalformedMessage
from .follower import DEFAULT_READY_MAX_LAG, FollowerHealth, LiveIndex
from .index import CacheIndex, IndexStats, Match
from .liveness import DEFAULT_STALE_AFTER_S, InstanceLiveness, Liveness
from .reader import DEFAULT_CONSUMER_CONFIG, EventReader, ReaderError
from .reader_metrics import PartitionState, ReaderMetrics, ReaderProgress, ReadResult, Throughput
from .workers import BlockEntry, WindowStats, WorkerKey, WorkerStats

__all__ = [
    "DEFAULT_CONSUMER_CONFIG",
    "DEFAULT_READY_MAX_LAG",
    "DEFAULT_STALE_AFTER_S",
    "BlockEntry",
    "CacheIndex",
    "Checkpoint",
    "CheckpointError",
    "EventReader",
    "FollowerHealth",
    "IndexStats",
    "InstanceLiveness",
    "KafkaCheckpointStore",
    "LiveIndex",
    "Liveness",
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
