"""``BlockInfo``: what an engine hands to ``KVCacheEventManager.enqueue_stored_event``.

TensorRT-LLM's manager receives ``BlockPtr``s and reads, per block, its hash, its unique tokens,
its LoRA task id, whether it is primary, its priority and its extra keys; the Stored event's
parent is the first block's previous block (none at the root). ``BlockInfo`` carries exactly
that, immutable, so the manager can keep a reference on the engine thread and build the event
objects later on its background worker.

All checks and conversions happen here, once, when the engine builds the block; the manager's
engine-thread path only records references.
"""

from __future__ import annotations

import operator
from array import array
from collections.abc import Iterable, Sequence

import msgspec
from kvevents.schemas import DEFAULT_PRIORITY, MM_HASH_SIZE, MmKey
from kvevents.schemas.model import IntArray
from msgspec.structs import force_setattr

from kvevents._brief import brief

__all__ = ["MAX_PRIORITY", "MIN_PRIORITY", "U64_MAX", "BlockInfo"]

U64_MAX = (1 << 64) - 1
"""Largest block hash / LoRA id / extra id (``size_t`` and ``uint64_t`` in the C++)."""
MIN_PRIORITY = 0
MAX_PRIORITY = 100
"""TensorRT-LLM's retention priorities range from 0 to 100."""


def _u64(name: str, value: object) -> int:
    """``value`` as a plain int in the unsigned 64-bit range (numpy integers accepted)."""
    if value.__class__ is not int:
        if isinstance(value, bool):
            raise ValueError(f"BlockInfo.{name} must be an unsigned 64-bit int, got {brief(value)}")
        try:
            value = operator.index(value)  # type: ignore[arg-type]
        except TypeError:
            raise ValueError(f"BlockInfo.{name} must be an unsigned 64-bit int, got {brief(value)}") from None
    if not 0 <= value <= U64_MAX:
        raise ValueError(f"BlockInfo.{name} must be an unsigned 64-bit int, got {brief(value)}")
    return value


def _int_array(name: str, typecode: str, values: Iterable[int]) -> array[int]:
    try:
        return array(typecode, values)
    except (OverflowError, TypeError) as exc:
        kind = "int32 token ids" if typecode == "i" else "unsigned 64-bit ints"
        raise ValueError(f"BlockInfo.{name} must be {kind}: {exc}") from None


def _mm_keys(values: Iterable[Sequence[object]]) -> tuple[MmKey, ...]:
    keys: list[MmKey] = []
    for item in values:
        try:
            content_hash, offset = item
        except (TypeError, ValueError):
            raise ValueError(
                f"BlockInfo.mm_keys items must be (32-byte hash, offset) pairs, got {brief(item)}"
            ) from None
        if not isinstance(content_hash, bytes | bytearray | memoryview) or len(content_hash) != MM_HASH_SIZE:
            raise ValueError(
                f"BlockInfo.mm_keys hash must be {MM_HASH_SIZE} bytes, got {brief(content_hash)}"
            )
        if offset.__class__ is not int or offset < 0:
            raise ValueError(f"BlockInfo.mm_keys offset must be a non-negative int, got {brief(offset)}")
        keys.append((bytes(content_hash), offset))
    return tuple(keys)


class BlockInfo(msgspec.Struct, frozen=True, gc=False):
    """One KV-cache block as the engine sees it when it stores the block.

    - ``block_hash``: the block's unsigned 64-bit hash.
    - ``prev_block_hash``: the hash of the block before it in its sequence; ``None`` at the root
      (the C++ parent is absent, or its block id is negative). Only the first block of a Stored
      event uses it: it becomes the event's ``parent_hash``.
    - ``tokens``: the block's unique token ids, kept as ``array('i')`` (converted on
      construction). Treat it as read-only: the manager shares it with the event it builds.
    - ``lora_id``: LoRA task id or ``None``; ``is_primary``: in primary (GPU) memory, which
      becomes cache level 0, else 1; ``priority``: retention priority 0..100 (default 35).
    - ``token_extra_ids``: one unsigned 64-bit extra id per token, ``array('Q')``, or ``None``
      (also when all are zero); ``mm_keys``: (32-byte multimodal hash, start offset) pairs;
      ``cache_salt``: the request's cache salt, or ``None``.

    Bad values raise ``ValueError`` naming the field.
    """

    block_hash: int
    prev_block_hash: int | None
    tokens: IntArray
    lora_id: int | None = None
    is_primary: bool = True
    priority: int = DEFAULT_PRIORITY
    token_extra_ids: IntArray | None = None
    mm_keys: tuple[MmKey, ...] = ()
    cache_salt: str | None = None

    def __post_init__(self) -> None:
        if self.block_hash.__class__ is not int or not 0 <= self.block_hash <= U64_MAX:
            force_setattr(self, "block_hash", _u64("block_hash", self.block_hash))
        prev = self.prev_block_hash
        if prev is not None and (prev.__class__ is not int or not 0 <= prev <= U64_MAX):
            force_setattr(self, "prev_block_hash", _u64("prev_block_hash", prev))
        tokens = self.tokens
        if tokens.__class__ is not array or tokens.typecode != "i":
            tokens = _int_array("tokens", "i", tokens)
            force_setattr(self, "tokens", tokens)
        if self.lora_id is not None:
            force_setattr(self, "lora_id", _u64("lora_id", self.lora_id))
        if self.is_primary.__class__ is not bool:
            raise ValueError(f"BlockInfo.is_primary must be a bool, got {brief(self.is_primary)}")
        priority = self.priority
        if priority.__class__ is not int or not MIN_PRIORITY <= priority <= MAX_PRIORITY:
            raise ValueError(
                f"BlockInfo.priority must be an int in {MIN_PRIORITY}..{MAX_PRIORITY}, got {brief(priority)}"
            )
        extra = self.token_extra_ids
        if extra is not None:
            if extra.__class__ is not array or extra.typecode != "Q":
                extra = _int_array("token_extra_ids", "Q", extra)
            if len(extra) != len(tokens):
                raise ValueError(
                    f"BlockInfo.token_extra_ids must have one id per token: {len(extra)} ids for {len(tokens)} tokens"
                )
            force_setattr(self, "token_extra_ids", extra if any(extra) else None)
        if self.mm_keys:
            force_setattr(self, "mm_keys", _mm_keys(self.mm_keys))
        elif self.mm_keys.__class__ is not tuple:
            force_setattr(self, "mm_keys", ())
        if self.cache_salt is not None and self.cache_salt.__class__ is not str:
            raise ValueError(f"BlockInfo.cache_salt must be a str or None, got {brief(self.cache_salt)}")
