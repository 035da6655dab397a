"""Pre-encoded pieces of vLLM's ``BlockStored``: ``token_ids`` and the hashes as msgpack bytes,
and the per-block ``extra_keys`` entry in vLLM's shape.

``pack_tokens(arrays)`` returns the msgpack array of the ints of several ``array('i')`` (a run
of blocks), which the converter hands to msgspec as ``msgspec.Raw`` (copied verbatim into the
batch). The compiled ``_packtokens`` writes it from the arrays' buffers without making a Python
int per token; :func:`py_pack_tokens` is the pure-Python twin (same bytes: msgspec's own).
``pack_hashes`` does the same for block hashes, each as a full 8-byte uint64 (compiled, with
:func:`py_pack_hashes` its twin).
"""

from __future__ import annotations

import logging
from array import array
from collections.abc import Callable, Sequence
from typing import Any

import msgspec

__all__ = ["extra_keys", "pack_hash", "pack_hashes", "pack_tokens", "py_pack_hashes", "py_pack_tokens"]

_ENCODE = msgspec.msgpack.Encoder().encode
_U64 = b"\xcf"


def py_pack_hashes(hashes: list[int]) -> bytes:
    """The msgpack array of ``hashes``, each a full 8-byte uint64 (``0xcf`` and 8 bytes, big
    endian) whatever its value (pure Python)."""
    n = len(hashes)
    if n < 16:
        head = bytes((0x90 | n,))
    elif n < 65536:
        head = b"\xdc" + n.to_bytes(2, "big")
    else:
        head = b"\xdd" + n.to_bytes(4, "big")
    return head + b"".join(_U64 + h.to_bytes(8, "big") for h in hashes)


def pack_hashes(hashes: list[int]) -> msgspec.Raw:
    """``hashes`` as a msgpack array of 8-byte uint64s, for a struct field: llm-d's decoder
    takes a hash only as a uint64, an int64 or bytes, and refuses the batch whole for the
    smaller ints msgpack writes a hash below 2**32 as (about once in 4 billion hashes)."""
    return msgspec.Raw(_pack_hashes(hashes))


def pack_hash(block_hash: int | None) -> msgspec.Raw | None:
    """One hash (a parent's) as a full 8-byte uint64, as :func:`pack_hashes`; None stays None."""
    return None if block_hash is None else msgspec.Raw(_U64 + block_hash.to_bytes(8, "big"))


def py_pack_tokens(arrays: Sequence[array[int]]) -> bytes:
    """The msgpack array of every int of ``arrays``, in order (pure Python)."""
    if len(arrays) == 1:
        return _ENCODE(arrays[0].tolist())
    joined = array("i")
    for tokens in arrays:
        joined.extend(tokens)
    return _ENCODE(joined.tolist())


def _pick() -> tuple[Callable[[Sequence[array[int]]], bytes], Callable[[list[int]], bytes]]:
    try:
        from ._packtokens import pack_hashes as compiled_hashes
        from ._packtokens import pack_tokens as compiled
    except ImportError:  # the optional extension was not built
        logging.getLogger(__name__).debug("_packtokens is not built; packing tokens in Python")
        return py_pack_tokens, py_pack_hashes
    return compiled, compiled_hashes


pack_tokens, _pack_hashes = _pick()


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
