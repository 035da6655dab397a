"""NVIDIA Dynamo's KV router, fed from kvevents: Dynamo's local block hashes and RouterEvent JSON.

Dynamo's ``RadixTree`` keys each block by its *local hash* (``tokens_hash``): XXH3-64 of the
block's token ids as unsigned 32-bit little-endian values, seed 1337, one hash per FULL block,
not chained (the tree gives the position). A LoRA adapter name mixes into the seed:
``seed = 1337 + xxh3_64(name)`` with u64 wraparound (Dynamo's ``wrapping_add``; an empty name
counts as none), and a cache namespace adds ``xxh3_64(namespace, seed=1)``. Multimodal blocks
append their objects' 64-bit hashes, sorted, as little-endian u64 after the tokens.

:func:`router_events` turns one kvevents batch into Dynamo ``KvCacheEvent`` dicts (the ``event``
of a Dynamo ``RouterEvent``; what ``RadixTree.apply_event`` reads). Mapping, checked against
Dynamo's serde definitions (``lib/kv-router`` ``protocols.rs``):

- Created -> ``"cleared"``; Stored -> ``{"stored": {"parent_hash", "blocks": [{"block_hash",
  "tokens_hash"}]}}``; Removed -> ``{"removed": {"block_hashes"}}``;
- Updated (cache level or priority) -> nothing: ``KvCacheEventData`` has no such variant and
  the tree has no levels, so a block is held whatever its level (as ``CacheIndex`` matches by
  default);
- ``dp_rank`` is the event's attention-DP rank (0 when None); hashes stay unsigned 64-bit.

kvevents carries LoRA *ids*; Dynamo hashes LoRA *names*. ``lora_names`` maps ids to names; an
id without a name hashes under its decimal string (never equal to the base model's blocks).
A cache salt is Dynamo's ``cache_namespace`` (a request's namespace is its ``cache_salt``),
which seeds every block of the request, so the blocks of a salted chain are hashed under it
(:func:`block_namespaces`).
"""

from __future__ import annotations

import struct
import sys
from array import array
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import xxhash
from kvevents.schemas import (
    EventBatch,
    KVCacheCreatedData,
    KVCacheEvent,
    KVCacheRemovedData,
    KVCacheStoredBlockData,
    KVCacheStoredData,
    MmKey,
)

from .workers import WorkerKey

__all__ = [
    "DYNAMO_SEED",
    "block_namespaces",
    "block_tokens_hash",
    "dynamo_seed",
    "local_block_hashes",
    "mm_key_hash",
    "router_event",
    "router_events",
    "worker_id_for",
]

DYNAMO_SEED = 1337
"""Dynamo's ``XXH3_SEED``."""
_MASK = (1 << 64) - 1
_xxh3 = xxhash.xxh3_64_intdigest
_LITTLE_ENDIAN = sys.byteorder == "little"


def dynamo_seed(lora_name: str | None = None, cache_namespace: str | None = None) -> int:
    """The XXH3 seed Dynamo hashes a request's blocks with (empty strings count as None)."""
    seed = DYNAMO_SEED
    for name, value in (("lora_name", lora_name), ("cache_namespace", cache_namespace)):
        if value is not None and not isinstance(value, str):
            raise TypeError(f"{name} must be a str or None, got {type(value).__name__}")
    if lora_name:
        seed = (seed + _xxh3(lora_name.encode("utf-8"))) & _MASK
    if cache_namespace:
        seed = (seed + _xxh3(cache_namespace.encode("utf-8"), seed=1)) & _MASK
    return seed


def _u32_bytes(tokens: Sequence[int]) -> bytes:
    """Token ids as u32 little-endian bytes; ValueError naming the first id outside 0..2**32-1."""
    if isinstance(tokens, array) and tokens.itemsize == 4 and tokens.typecode in ("i", "I"):
        # kvevents' blocks hold array('i'): no conversion unless an id is negative
        data: array[int] | None = tokens
        if tokens.typecode == "i" and tokens and min(tokens) < 0:
            data = None
    else:
        data = None
    if data is None:
        try:
            data = array("I", tokens)
        except (OverflowError, TypeError):
            bad = next((t for t in tokens if not (isinstance(t, int) and 0 <= t <= 0xFFFFFFFF)), None)
            raise ValueError(f"token id {bad!r} is outside Dynamo's u32 token range") from None
    if _LITTLE_ENDIAN:
        return data.tobytes()
    return struct.pack(f"<{len(data)}I", *(t & 0xFFFFFFFF for t in data))  # pragma: no cover


def _routable_bytes(tokens: Sequence[int]) -> bytes | None:
    """A stored block's tokens as Dynamo hashes them (u32 little-endian), or None when Dynamo
    could not key it (no tokens, or a negative id: kvevents' ids are int32)."""
    if not len(tokens):
        return None
    if (
        _LITTLE_ENDIAN
        and isinstance(tokens, array)
        and tokens.itemsize == 4
        and tokens.typecode in ("i", "I")
    ):
        raw = tokens.tobytes()
        # an int32 is negative when its last byte's top bit is set: one pass over bytes, not ints
        return None if tokens.typecode == "i" and max(raw[3::4]) >= 0x80 else raw
    if min(tokens) < 0:
        return None
    return _u32_bytes(tokens)


def mm_key_hash(key: MmKey) -> int:
    """Dynamo's 64-bit hash of a multimodal object from kvevents' 32-byte content hash: the
    first 16 hex digits of its hex form (how Dynamo maps vLLM's 64-hex-digit identifiers)."""
    return int.from_bytes(key[0][:8], "big")


def local_block_hashes(
    tokens: Sequence[int],
    block_size: int,
    lora_name: str | None = None,
    *,
    cache_namespace: str | None = None,
) -> list[int]:
    """Dynamo's ``compute_block_hash_for_seq``: one local hash per FULL block of ``tokens``
    (a trailing partial block is not hashed). ValueError for ``block_size < 1`` or a token id
    outside 0..2**32-1."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    seed = dynamo_seed(lora_name, cache_namespace)
    data = _u32_bytes(tokens)
    step = 4 * block_size
    return [_xxh3(data[i : i + step], seed=seed) for i in range(0, len(data) - step + 1, step)]


def block_tokens_hash(tokens: Sequence[int], seed: int = DYNAMO_SEED, mm_hashes: Sequence[int] = ()) -> int:
    """Dynamo's local hash of one block (all of its tokens), multimodal hashes appended sorted."""
    return _hash_block_bytes(_u32_bytes(tokens), seed, mm_hashes)


def _hash_block_bytes(data: bytes, seed: int, mm_hashes: Sequence[int]) -> int:
    if mm_hashes:
        data += b"".join(struct.pack("<Q", h & _MASK) for h in sorted(mm_hashes))
    return _xxh3(data, seed=seed)


def _block_seed(
    block: KVCacheStoredBlockData, lora_names: Mapping[int, str] | None, namespace: str | None = None
) -> int:
    if block.lora_id is None:
        return DYNAMO_SEED if namespace is None else dynamo_seed(None, namespace)
    name = lora_names.get(block.lora_id) if lora_names is not None else None
    return dynamo_seed(name if name is not None else str(block.lora_id), namespace)


def block_namespaces(
    blocks: Sequence[KVCacheStoredBlockData], parent_namespace: str | None = None
) -> list[str | None]:
    """Each block's Dynamo ``cache_namespace``: the cache salt its chain started with. A salt
    is on a request's first block (TensorRT-LLM, vLLM) or on every block of it (SGLang), while
    Dynamo hashes every block of a salted request under the salt (a request's namespace is its
    ``cache_salt``), so a block without one takes its parent's: the previous block's, and for
    the first, ``parent_namespace`` (that of the event's parent, which a caller tracking the
    stream knows)."""
    out: list[str | None] = []
    namespace = parent_namespace
    for block in blocks:
        if block.cache_salt is not None:
            namespace = block.cache_salt or None
        out.append(namespace)
    return out


def stored_block_dict(
    block: KVCacheStoredBlockData, lora_names: Mapping[int, str] | None = None, namespace: str | None = None
) -> dict[str, int]:
    """``{"block_hash", "tokens_hash"}`` of one stored block (hashed under ``namespace``, a
    cache salt: :func:`block_namespaces`)."""
    return _stored_block_dict(block, _u32_bytes(block.tokens), lora_names, namespace)


def _stored_block_dict(
    block: KVCacheStoredBlockData, data: bytes, lora_names: Mapping[int, str] | None, namespace: str | None
) -> dict[str, int]:
    mm = [mm_key_hash(k) for k in block.mm_keys] if block.mm_keys else ()
    return {
        "block_hash": block.block_hash,
        "tokens_hash": _hash_block_bytes(data, _block_seed(block, lora_names, namespace), mm),
    }


def router_event(
    event: KVCacheEvent,
    lora_names: Mapping[int, str] | None = None,
    *,
    parent_namespace: str | None = None,
) -> dict[str, Any] | None:
    """The Dynamo ``KvCacheEvent`` dict of one event (None for an Updated event: no counterpart).

    A Stored event's blocks from the first one without tokens on (a placeholder, such as vLLM's
    offloading connector sends) are left out: Dynamo keys a block by its tokens' hash, under
    which every such block would be the same one; so are those from the first one with a
    negative token id on (kvevents' ids are int32, Dynamo's u32: no Dynamo request hashes to
    it). None when no block is left. Salted blocks
    are hashed under their chain's salt as Dynamo's ``cache_namespace``
    (:func:`block_namespaces`; ``parent_namespace``: the event's parent's)."""
    data = event.data
    body: Any
    kind = type(data)
    if kind is KVCacheStoredData:
        kept: list[tuple[KVCacheStoredBlockData, bytes]] = []
        for block in data.blocks:  # type: ignore[union-attr]
            raw = _routable_bytes(block.tokens)
            if raw is None:
                break
            kept.append((block, raw))
        if not kept:
            return None
        namespaces = block_namespaces([b for b, _ in kept], parent_namespace)
        body = {
            "stored": {
                "parent_hash": data.parent_hash,  # type: ignore[union-attr]
                "blocks": [
                    _stored_block_dict(b, raw, lora_names, ns)
                    for (b, raw), ns in zip(kept, namespaces, strict=True)
                ],
            }
        }
    elif kind is KVCacheRemovedData:
        body = {"removed": {"block_hashes": list(data.block_hashes)}}  # type: ignore[union-attr]
    elif kind is KVCacheCreatedData:
        body = "cleared"
    else:
        return None  # Updated: no Dynamo counterpart
    return {"event_id": event.event_id, "data": body, "dp_rank": event.attention_dp_rank or 0}


def router_events(
    batch: EventBatch,
    *,
    lora_names: Mapping[int, str] | None = None,
    window_size: int | None = None,
) -> list[tuple[WorkerKey, dict[str, Any]]]:
    """Dynamo ``KvCacheEvent`` dicts for every event of ``batch`` that has a Dynamo
    counterpart (see the module docstring), each with its worker, in order.

    ``window_size`` keeps only that window size's events (Dynamo has one cache per worker).
    A salt reaches the blocks after it within an event only: across events (a chain continued
    by a later one) :class:`~kvevents.consumer.export.dynamo_export.DynamoConverter` tracks it.
    """
    out: list[tuple[WorkerKey, dict[str, Any]]] = []
    instance = batch.instance_id
    for event in batch.events:
        if window_size is not None and event.window_size != window_size:
            continue
        mapped = router_event(event, lora_names)
        if mapped is not None:
            out.append((WorkerKey(instance, mapped["dp_rank"]), mapped))
    return out


def worker_id_for(instance_id: str) -> int:
    """A stable Dynamo worker id (u64 below 2**63) for an engine instance id: XXH3-64 of its
    UTF-8 bytes, top bit cleared (Dynamo worker ids are etcd lease ids, kvevents' are names)."""
    return _xxh3(instance_id.encode("utf-8")) & 0x7FFF_FFFF_FFFF_FFFF


WorkerIds = Callable[[str], int]
"""Maps an instance id to a Dynamo worker id (default :func:`worker_id_for`)."""
