"""Pre-encoded pieces of vLLM's ``BlockStored``: ``token_ids`` as msgpack bytes, and the
per-block ``extra_keys`` entry in vLLM's shape.

``pack_tokens(arrays)`` returns the msgpack array of the ints of several ``array('i')`` (a run
of blocks), which the converter hands to msgspec as ``msgspec.Raw`` (copied verbatim into the
batch). The compiled ``_packtokens`` writes it from the arrays' buffers without making a Python
int per token; :func:`py_pack_tokens` is the pure-Python twin (same bytes: msgspec's own).
"""

from __future__ import annotations

import logging
from array import array
from collections.abc import Callable, Sequence
from typing import Any

import msgspec

__all__ = ["extra_keys", "pack_tokens", "py_pack_tokens"]

_ENCODE = msgspec.msgpack.Encoder().encode


def py_pack_tokens(arrays: Sequence[array[int]]) -> bytes:
    """The msgpack array of every int of ``arrays``, in order (pure Python)."""
    if len(arrays) == 1:
        return _ENCODE(arrays[0].tolist())
    joined = array("i")
    for tokens in arrays:
        joined.extend(tokens)
    return _ENCODE(joined.tolist())


def _pick() -> Callable[[Sequence[array[int]]], bytes]:
    try:
        from ._packtokens import pack_tokens as compiled
    except ImportError:  # the optional extension was not built
        logging.getLogger(__name__).debug("_packtokens is not built; packing tokens in Python")
        return py_pack_tokens
    return compiled


pack_tokens = _pick()


def extra_keys(lora_name: str | None, mm_keys: Sequence[tuple[bytes, int]], salt: str | None) -> Any:
    """One block's entry of vLLM's ``BlockStored.extra_keys``, as vLLM's
    ``generate_block_hash_extra_keys`` orders it: the LoRA name, then ``(mm identifier, offset
    of the item relative to the block)`` per multimodal item (the identifier as the hex string
    of kvevents' 32-byte hash), then the cache salt (vLLM adds it to the first block of a
    request only: the caller passes it for a block without parent). None when empty."""
    keys: list[Any] = [] if lora_name is None else [lora_name]
    keys.extend((digest.hex(), offset) for digest, offset in mm_keys)
    if salt is not None:
        keys.append(salt)
    return tuple(keys) if keys else None
