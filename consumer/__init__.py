"""kvevents.consumer: the reader side (Kafka reader, global cache index, checkpoints)."""

from .index import CacheIndex, IndexStats, Match
from .workers import BlockEntry, WindowStats, WorkerKey, WorkerStats

__all__ = ["BlockEntry", "CacheIndex", "IndexStats", "Match", "WindowStats", "WorkerKey", "WorkerStats"]
