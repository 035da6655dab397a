"""The KV-cache event model: TensorRT-LLM's ``executor`` event types, in snake_case.

Every type is an immutable ``msgspec.Struct`` (cheap to build, compared by value). Sequences
that can be long are compact: a block's ``tokens`` are an ``array('i')`` and its
``token_extra_ids`` an ``array('Q')``; both are converted from any integer sequence on
construction. Other lists (``blocks``, ``block_hashes``, ...) are plain ``list`` objects.

Block hashes, LoRA ids and extra ids are unsigned 64-bit integers here, as ``size_t`` /
``uint64_t`` are in the C++; the codec maps them to Avro's signed ``long`` and back.
"""

from __future__ import annotations

from array import array
from typing import TYPE_CHECKING, TypeAlias

import msgspec
from msgspec.structs import force_setattr

__all__ = [
    "DEFAULT_PRIORITY",
    "MM_HASH_SIZE",
    "PRIMARY_LEVEL",
    "SECONDARY_LEVEL",
    "EventBatch",
    "KVCacheCreatedData",
    "KVCacheEvent",
    "KVCacheEventData",
    "KVCacheEventDiff",
    "KVCacheRemovedData",
    "KVCacheStoredBlockData",
    "KVCacheStoredData",
    "KVCacheUpdatedData",
    "MmKey",
    "RankDrops",
]

if TYPE_CHECKING:
    IntArray: TypeAlias = array[int]
else:  # array is not subscriptable at run time before Python 3.12, and msgspec may read the hints
    IntArray = array

PRIMARY_LEVEL = 0
"""Cache level of blocks in primary (GPU) memory."""
SECONDARY_LEVEL = 1
"""Cache level of blocks offloaded to secondary (host) memory."""
DEFAULT_PRIORITY = 35
"""TensorRT-LLM's default block retention priority (range 0..100)."""

WIDE_TOKEN_ID = 2**31 - 1
"""The token id that stands for a token the schema's 32-bit ``tokens`` cannot carry (SGLang's
64-bit multimodal pad values, TensorRT-LLM's multimodal digest tokens): past every vocabulary,
and in range for Dynamo's u32 tokens. The token's value (a digest: its first 8 bytes, big
endian) is its entry in ``token_extra_ids``, so blocks of different items never share a
content hash."""

MM_HASH_SIZE = 32
"""Bytes in a multimodal content hash (Avro ``fixed`` ``kvevents.MmHash``)."""

MmKey: TypeAlias = tuple[bytes, int]
"""A multimodal key: (32-byte content hash, start offset in tokens relative to the block)."""


class KVCacheEventDiff(msgspec.Struct, frozen=True, gc=False):
    """A change of one block attribute: ``old_value`` became ``new_value``."""

    old_value: int
    new_value: int


class KVCacheCreatedData(msgspec.Struct, frozen=True, gc=False):
    """A cache was created: capacity in blocks per cache level (primary first).

    ``snapshot`` is True when the producer re-publishes a worker's whole cache after a loss
    (a resync, see ``KVCacheEventManager.enqueue_snapshot``): not a new cache, but consumers
    reset the worker all the same, and the Stored events that follow restore its blocks.
    """

    num_blocks_per_cache_level: list[int]
    snapshot: bool = False


class KVCacheStoredBlockData(msgspec.Struct, frozen=True, gc=False):
    """One stored block: its hash, token ids and attributes."""

    block_hash: int
    tokens: IntArray
    lora_id: int | None = None
    cache_level: int = PRIMARY_LEVEL
    priority: int = DEFAULT_PRIORITY
    token_extra_ids: IntArray | None = None
    mm_keys: tuple[MmKey, ...] = ()
    cache_salt: str | None = None

    def __post_init__(self) -> None:
        tokens = self.tokens
        if tokens.__class__ is not array or tokens.typecode != "i":
            tokens = array("i", tokens)
            force_setattr(self, "tokens", tokens)
        extra = self.token_extra_ids
        if extra is not None:
            if extra.__class__ is not array or extra.typecode != "Q":
                extra = array("Q", extra)
            if len(extra) != len(tokens):
                raise ValueError(
                    f"token_extra_ids has {len(extra)} ids for {len(tokens)} tokens (one per token)"
                )
            # "None when all are zero": one spelling for one meaning, so equality holds.
            force_setattr(self, "token_extra_ids", extra if any(extra) else None)
        mm_keys = self.mm_keys
        if mm_keys:
            force_setattr(self, "mm_keys", tuple(_mm_key(key) for key in mm_keys))
        elif mm_keys.__class__ is not tuple:
            force_setattr(self, "mm_keys", ())


def _mm_key(key: tuple[bytes, int]) -> MmKey:
    content_hash, start_offset = key
    if not isinstance(content_hash, (bytes, bytearray, memoryview)):
        raise TypeError(f"a multimodal hash must be bytes, not {type(content_hash).__name__}")
    content_hash = bytes(content_hash)
    if len(content_hash) != MM_HASH_SIZE:
        raise ValueError(f"a multimodal hash has {MM_HASH_SIZE} bytes, got {len(content_hash)}")
    return (content_hash, int(start_offset))


class KVCacheStoredData(msgspec.Struct, frozen=True, gc=False):
    """Blocks stored; block ``i`` has block ``i-1`` as parent, the first has ``parent_hash``."""

    parent_hash: int | None
    blocks: list[KVCacheStoredBlockData]


class KVCacheRemovedData(msgspec.Struct, frozen=True, gc=False):
    """Blocks evicted from the cache."""

    block_hashes: list[int]


class KVCacheUpdatedData(msgspec.Struct, frozen=True, gc=False):
    """A block moved between cache levels, or its priority changed."""

    block_hash: int
    cache_level: KVCacheEventDiff | None = None
    priority: KVCacheEventDiff | None = None


KVCacheEventData: TypeAlias = KVCacheCreatedData | KVCacheStoredData | KVCacheRemovedData | KVCacheUpdatedData


class KVCacheEvent(msgspec.Struct, frozen=True, gc=False):
    """One event of one rank's cache, with its per-rank id and window size."""

    event_id: int
    data: KVCacheEventData
    window_size: int
    attention_dp_rank: int | None = None


class RankDrops(msgspec.Struct, frozen=True, gc=False):
    """How many events of one source rank were lost before the batch that carries this."""

    attention_dp_rank: int
    dropped_events: int


class EventBatch(msgspec.Struct, frozen=True, gc=False):
    """The unit produced to Kafka: one instance's events plus what reveals loss.

    ``sequence`` counts batches per ``producer_id`` without gaps; ``dropped`` lists, per
    source rank, events dropped since the previous batch; ``first_event_block_offset`` > 0
    marks a batch whose first event continues a Stored event split to fit the broker's
    ``message.max.bytes`` (same ``event_id``, blocks from that index on).
    """

    instance_id: str
    events: list[KVCacheEvent]
    attention_dp_size: int = 1
    producer_id: int = 0
    sequence: int = 0
    created_at_us: int = 0
    dropped: list[RankDrops] = []
    first_event_block_offset: int = 0
