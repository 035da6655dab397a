"""Engines in: vLLM and SGLang KV events over ZMQ, converted to kvevents events.

``ZmqEventConverter`` is the pure conversion of one payload; the live bridge (sockets, replay,
state) lives in :mod:`.live` and needs the ``bridge`` extra (pyzmq).
"""

from .convert import ENGINES, ZmqEventConverter
from .hashes import DEFAULT_MEDIUM_LEVELS, fold_hash, lora_id_for_name
from .tiers import TierChange, TierMap
from .wire import BridgeDecodeError, WireCounts

__all__ = [
    "DEFAULT_MEDIUM_LEVELS",
    "ENGINES",
    "BridgeDecodeError",
    "TierChange",
    "TierMap",
    "WireCounts",
    "ZmqEventConverter",
    "fold_hash",
    "lora_id_for_name",
]
