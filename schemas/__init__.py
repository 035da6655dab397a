"""kvevents.schemas: the wire contract shared by producers and consumers.

The event model (TensorRT-LLM's executor types in snake_case), the Avro schemas (``avro/*.avsc``,
the source of truth; ``avro/README.md`` states the compatibility rule they evolve by) and the
codec (:mod:`.codec`, single-object framing; :mod:`.registry`, the Confluent wire format with a
schema registry). This package imports neither the producer nor the consumer.
"""

from .codec import (
    CONTENT_TYPE,
    current_fingerprint,
    decode_batch,
    decode_body,
    decode_record,
    encode_batch,
    encode_body,
    fast_path_enabled,
    register_writer_schema,
)
from .errors import DecodeError, EncodeError, LimitError
from .limits import DEFAULT_LIMITS, BatchLimits, check_batch
from .model import (
    DEFAULT_PRIORITY,
    MM_HASH_SIZE,
    PRIMARY_LEVEL,
    SECONDARY_LEVEL,
    WIDE_TOKEN_ID,
    EventBatch,
    KVCacheCreatedData,
    KVCacheEvent,
    KVCacheEventData,
    KVCacheEventDiff,
    KVCacheRemovedData,
    KVCacheStoredBlockData,
    KVCacheStoredData,
    KVCacheUpdatedData,
    MmKey,
    RankDrops,
)

__all__ = [
    "CONTENT_TYPE",
    "DEFAULT_LIMITS",
    "DEFAULT_PRIORITY",
    "MM_HASH_SIZE",
    "PRIMARY_LEVEL",
    "SECONDARY_LEVEL",
    "WIDE_TOKEN_ID",
    "BatchLimits",
    "DecodeError",
    "EncodeError",
    "EventBatch",
    "KVCacheCreatedData",
    "KVCacheEvent",
    "KVCacheEventData",
    "KVCacheEventDiff",
    "KVCacheRemovedData",
    "KVCacheStoredBlockData",
    "KVCacheStoredData",
    "KVCacheUpdatedData",
    "LimitError",
    "MmKey",
    "RankDrops",
    "check_batch",
    "current_fingerprint",
    "decode_batch",
    "decode_body",
    "decode_record",
    "encode_batch",
    "encode_body",
    "fast_path_enabled",
    "register_writer_schema",
]
