"""Block identity in the simulator: token arrays, chained block hashes, retention ranges, and
the ``HeldBlock`` records of the ground truth."""

from __future__ import annotations

import struct
import sys
from array import array
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import xxhash

__all__ = [
    "HeldBlock",
    "RetentionRange",
    "block_hashes",
    "chained_block_hash",
    "retention_priorities",
    "retention_priority",
    "to_token_array",
]

_ROOT_SEED = 0
_LORA = struct.Struct("<Q")
_BIG_ENDIAN = sys.byteorder == "big"
_xxh3 = xxhash.xxh3_64_intdigest


def to_token_array(tokens: Iterable[int]) -> array[int]:
    """``tokens`` as ``array('i')`` (returned as is when it already is one)."""
    if tokens.__class__ is array and tokens.typecode == "i":
        return tokens
    try:
        return array("i", tokens)
    except (OverflowError, TypeError) as exc:
        raise ValueError(f"token ids must be int32 values: {exc}") from None


def chained_block_hash(parent_hash: int | None, tokens: Iterable[int], lora_id: int | None = None) -> int:
    """The unsigned 64-bit hash of one block, chained to its parent.

    ``xxh3_64(data, seed=parent_hash or 0)`` where ``data`` is the block's token ids packed as
    little-endian int32, followed by the LoRA id as little-endian uint64 when there is one. The
    parent hash as seed chains the blocks (equal hashes mean equal whole prefixes, with
    overwhelming probability); it is deterministic across processes, runs and machines.
    TensorRT-LLM's own V1 hash is a different mixer with the same inputs; consumers only need
    hashes to be chained and deterministic.
    """
    arr = to_token_array(tokens)
    seed = _ROOT_SEED if parent_hash is None else parent_hash
    if lora_id is None and not _BIG_ENDIAN:
        return _xxh3(arr, seed=seed)  # the array's buffer: its little-endian int32 bytes
    if _BIG_ENDIAN:
        arr = array("i", arr)
        arr.byteswap()
    data = arr.tobytes()
    if lora_id is not None:
        data += _LORA.pack(lora_id)
    return _xxh3(data, seed=seed)


def block_hashes(
    tokens: Iterable[int],
    block_size: int,
    lora_id: int | None = None,
    *,
    parent_hash: int | None = None,
    max_blocks: int | None = None,
) -> list[int]:
    """The chained hashes of the full blocks of ``tokens`` (a partial last block has none)."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    arr = to_token_array(tokens)
    count = len(arr) // block_size
    if max_blocks is not None:
        count = min(count, max_blocks)
    hashes: list[int] = []
    if lora_id is None and not _BIG_ENDIAN:  # chained_block_hash on views of the array, no copies
        seed = _ROOT_SEED if parent_hash is None else parent_hash
        view = memoryview(arr)
        for start in range(0, count * block_size, block_size):
            seed = _xxh3(view[start : start + block_size], seed=seed)
            hashes.append(seed)
        view.release()  # the array may grow later (a held export would forbid it)
        return hashes
    parent = parent_hash
    for i in range(count):
        parent = chained_block_hash(parent, arr[i * block_size : (i + 1) * block_size], lora_id)
        hashes.append(parent)
    return hashes


class RetentionRange(NamedTuple):
    """A retention priority for the blocks within ``[start, end)`` tokens of a sequence.

    Like TensorRT-LLM's ``TokenRangeRetentionConfig``: ``end=None`` reaches to the end of the
    sequence (generated tokens included). A block takes the priority of the first range that
    covers all its tokens; a block no range covers keeps its priority (new blocks: 35).
    """

    start: int
    end: int | None
    priority: int


def retention_priority(ranges: Sequence[RetentionRange], index: int, block_size: int) -> int | None:
    """The priority of block ``index`` by the first range covering all its tokens, or None."""
    first = index * block_size
    last = first + block_size
    for r in ranges:
        if r.start <= first and (r.end is None or last <= r.end):
            return r.priority
    return None


def retention_priorities(
    ranges: Sequence[RetentionRange], block_size: int, start: int, stop: int
) -> list[int | None]:
    """``[retention_priority(ranges, i, block_size) for i in range(start, stop)]``, a few slice
    assignments instead of a call and a scan of the ranges per block."""
    out: list[int | None] = [None] * max(stop - start, 0)
    for r in reversed(ranges):  # the first covering range wins: it is written last
        lo = max(start, -(-r.start // block_size))  # first block whose tokens all lie at or after start
        hi = stop if r.end is None else min(stop, r.end // block_size)  # blocks ending by end
        if lo < hi:
            out[lo - start : hi - start] = [r.priority] * (hi - lo)
    return out


@dataclass(frozen=True, slots=True)
class HeldBlock:
    """One block the cache holds: the ground truth a consumer's index must reproduce."""

    block_hash: int
    parent_hash: int | None
    cache_level: int
    priority: int
    tokens: tuple[int, ...]
    lora_id: int | None = None

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict (hashes as unsigned ints)."""
        return {
            "block_hash": self.block_hash,
            "parent_hash": self.parent_hash,
            "cache_level": self.cache_level,
            "priority": self.priority,
            "tokens": list(self.tokens),
            "lora_id": self.lora_id,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> HeldBlock:
        """The inverse of :meth:`to_json`."""
        return cls(
            block_hash=int(data["block_hash"]),
            parent_hash=None if data["parent_hash"] is None else int(data["parent_hash"]),
            cache_level=int(data["cache_level"]),
            priority=int(data["priority"]),
            tokens=tuple(int(t) for t in data["tokens"]),
            lora_id=None if data.get("lora_id") is None else int(data["lora_id"]),
        )
