"""The fast path of :mod:`.wire`: the common vLLM/SGLang shapes decoded straight into typed msgspec
Structs (tagged maps with ``"type"``, or tag-first arrays, as the engines declare them).

:func:`fast_parse` returns the same :class:`ParsedBatch` as :func:`.wire.parse_payload` would, or
``None`` on anything it does not take exactly as the tolerant path would (an unknown tag or
field, a digest hash, a metadata map, a bad value...): the caller then runs the tolerant path,
which counts, converts or names the error. It never raises and never counts anything.
"""

from __future__ import annotations

from array import array
from typing import TYPE_CHECKING, Any

import msgspec
from kvevents.schemas import (
    DEFAULT_PRIORITY,
    PRIMARY_LEVEL,
    KVCacheCreatedData,
    KVCacheEvent,
    KVCacheStoredBlockData,
)

from .hashes import U64_MASK
from .wire import ParsedBatch, RawCleared, RawEvent, RawRemoved, RawStored

if TYPE_CHECKING:
    from .convert import ZmqEventConverter

__all__ = ["fast_convert", "fast_parse"]

_CLEARED = RawCleared()


# -- maps with a "type" tag (vLLM after #42892, SGLang 0.5.2x) --------------------------------


class _MapStored(msgspec.Struct, tag_field="type", tag="BlockStored", forbid_unknown_fields=True):
    block_hashes: list[int]
    parent_block_hash: int | None = None
    token_ids: list[int] | None = None
    block_size: int | None = None
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    cache_salt: str | None = None
    session_id: Any = None


class _MapRemoved(msgspec.Struct, tag_field="type", tag="BlockRemoved", forbid_unknown_fields=True):
    block_hashes: list[int]
    medium: str | None = None
    group_idx: int | None = None


class _MapCleared(msgspec.Struct, tag_field="type", tag="AllBlocksCleared", forbid_unknown_fields=True):
    pass


class _MapBatch(msgspec.Struct, forbid_unknown_fields=True):
    events: list[_MapStored | _MapRemoved | _MapCleared]
    ts: float | None = None
    data_parallel_rank: int | None = None
    attn_dp_rank: int | None = None
    dp_rank: int | None = None


# -- arrays, tag first (vLLM before #42892, SGLang 0.4/0.5) -----------------------------------


class _ArrayStored(msgspec.Struct, array_like=True, tag="BlockStored", forbid_unknown_fields=True):
    block_hashes: list[int]
    parent_block_hash: int | None = None
    token_ids: list[int] | None = None
    block_size: int | None = None
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class _ArrayRemoved(msgspec.Struct, array_like=True, tag="BlockRemoved", forbid_unknown_fields=True):
    block_hashes: list[int]
    medium: str | None = None
    group_idx: int | None = None


class _ArrayCleared(msgspec.Struct, array_like=True, tag="AllBlocksCleared", forbid_unknown_fields=True):
    pass


class _ArrayBatch(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    ts: float | None
    events: list[_ArrayStored | _ArrayRemoved | _ArrayCleared]
    dp_rank: int | None = None


class _ArrayBatchOfMaps(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    """Current vLLM: its ``EventBatch`` stayed an array when its events became maps."""

    ts: float | None
    events: list[_MapStored | _MapRemoved | _MapCleared]
    dp_rank: int | None = None


_map_decoder = msgspec.msgpack.Decoder(_MapBatch)
_array_decoder = msgspec.msgpack.Decoder(_ArrayBatch)
_array_of_maps_decoder = msgspec.msgpack.Decoder(_ArrayBatchOfMaps)


class _Mismatch(Exception):
    """Not a shape the fast path takes as the tolerant path would."""


def _decode(payload: bytes) -> tuple[Any, int | None] | None:
    """The batch struct and its dp rank (None: not named), or None when not of the fast shapes."""
    if not payload or payload.__class__ is not bytes:
        return None
    first = payload[0]
    try:
        if 0x80 <= first <= 0x8F or first in (0xDE, 0xDF):  # a map
            batch: Any = _map_decoder.decode(payload)
            rank = batch.data_parallel_rank
            if rank is None:
                rank = batch.attn_dp_rank if batch.attn_dp_rank is not None else batch.dp_rank
        elif 0x90 <= first <= 0x9F or first in (0xDC, 0xDD):  # an array
            try:
                batch = _array_decoder.decode(payload)
            except msgspec.DecodeError:  # its events maps (current vLLM)?
                batch = _array_of_maps_decoder.decode(payload)
            rank = batch.dp_rank
        else:
            return None
    except (msgspec.DecodeError, RecursionError):  # the tolerant path says why
        return None
    if rank is not None and rank < 0:
        return None
    return batch, rank


def fast_parse(payload: bytes) -> ParsedBatch | None:
    """The payload read by typed decoding, or ``None`` when the tolerant path must read it."""
    decoded = _decode(payload)
    if decoded is None:
        return None
    batch, rank = decoded
    try:
        events = [_event(e) for e in batch.events]
    except (_Mismatch, TypeError, OverflowError, ValueError):
        return None
    return ParsedBatch(batch.ts, rank, events)


def fast_convert(conv: ZmqEventConverter, payload: bytes) -> tuple[list[KVCacheEvent], float | None] | None:
    """``conv.convert(payload)`` in one pass for the plainest batches (no groups, LoRA, extra
    keys, new media or blockless tokens), or ``None`` (nothing changed) for the other paths."""
    decoded = _decode(payload)
    if decoded is None:
        return None
    batch, rank = decoded
    media = conv.media
    plan: list[tuple[bool, int, int | None, Any] | None] = []
    partial = 0
    # First validate and build every block: nothing of the converter changes before all is read.
    try:
        for e in batch.events:
            cls = e.__class__
            if cls is _MapCleared or cls is _ArrayCleared:
                plan.append(None)
                continue
            if e.group_idx is not None:
                return None
            medium = e.medium
            level = 0 if medium is None else media.get(medium)
            if level is None:
                return None
            hashes = e.block_hashes
            if hashes and min(hashes) < 0:
                hashes = [h & U64_MASK for h in hashes]
            if cls is _MapRemoved or cls is _ArrayRemoved:
                plan.append((False, level, None, hashes))
                continue
            extra = e.extra_keys  # vLLM sends [None] * blocks for blocks with no extra keys
            if (
                (extra is not None and (len(extra) != len(hashes) or any(k is not None for k in extra)))
                or e.lora_id is not None
                or e.lora_name is not None
                or e.kv_cache_spec_kind is not None
                or e.kv_cache_spec_sliding_window is not None
            ):
                return None
            n = len(hashes)
            raw_tokens = e.token_ids
            size = e.block_size
            if not raw_tokens:
                if n or (size is not None and size < 1):
                    return None  # blocks without tokens (counted), or a bad block_size
                plan.append((True, level, None, []))
                continue
            if size is None or size < 1 or not (n - 1) * size < len(raw_tokens) <= n * size:
                return None
            tokens = array("i", raw_tokens)  # OverflowError: not an int32
            if len(tokens) < n * size:
                partial += 1
            pieces = [tokens] if n == 1 else [tokens[i * size : (i + 1) * size] for i in range(n)]
            salt = e.cache_salt if cls is _MapStored else None
            blocks = [
                KVCacheStoredBlockData(h, p, None, PRIMARY_LEVEL, DEFAULT_PRIORITY, None, (), salt)
                for h, p in zip(hashes, pieces, strict=True)
            ]
            parent = e.parent_block_hash
            plan.append((True, level, None if parent is None else parent & U64_MASK, blocks))
    except (TypeError, OverflowError, ValueError):
        return None
    window = conv.window_size
    out: list[tuple[Any, int]] = []
    for step in plan:
        if step is None:
            conv.counts["cleared"] += 1
            conv.tiers.clear()
            out.append((KVCacheCreatedData([]), window))
        elif step[0]:
            conv._emit_blocks(out, window, step[1], step[2], step[3])
        else:
            conv._emit_gone(out, window, step[1], step[3])
    if partial:
        conv.counts["partial_blocks"] += partial
    return conv._numbered(out, conv.dp_rank if rank is None else rank), batch.ts


def _event(e: Any) -> RawEvent:
    cls = e.__class__
    if cls is _MapStored or cls is _ArrayStored:
        return _stored(e, e.cache_salt if cls is _MapStored else None)
    if cls is _MapRemoved or cls is _ArrayRemoved:
        return RawRemoved([h & U64_MASK for h in e.block_hashes], e.medium, e.group_idx)
    return _CLEARED


def _stored(e: Any, cache_salt: str | None) -> RawStored:
    hashes = [h & U64_MASK for h in e.block_hashes]
    raw_tokens = e.token_ids
    tokens = array("i", raw_tokens) if raw_tokens else array("i")  # OverflowError: not int32
    block_size = e.block_size
    if block_size is None:
        if hashes and tokens:
            raise _Mismatch
        block_size = 1
    elif block_size < 1:
        raise _Mismatch
    window = e.kv_cache_spec_sliding_window
    if window is not None and window < 0:
        raise _Mismatch
    parent = e.parent_block_hash
    return RawStored(
        hashes,
        None if parent is None else parent & U64_MASK,
        tokens,
        block_size,
        e.lora_id,
        e.medium,
        e.lora_name,
        e.extra_keys,
        e.group_idx,
        e.kv_cache_spec_kind,
        window,
        cache_salt,
    )
