"""kvevents.producer: the engine side (per-rank event manager, MPI gather, Kafka sink)."""

from .block import BlockInfo
from .buffer import EventBuffer, EventDrain
from .manager import KVCacheEventManager
from .stats import BufferStats, ManagerStats

__all__ = [
    "BlockInfo",
    "BufferStats",
    "EventBuffer",
    "EventDrain",
    "KVCacheEventManager",
    "ManagerStats",
]
