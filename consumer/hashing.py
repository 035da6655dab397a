"""Content hashes: what a block holds, computed by the index from the tokens Stored events carry.

Engine block hashes cannot be reproduced by a router: vLLM and SGLang seed theirs per process,
and TensorRT-LLM's depend on its version. The index therefore computes its own *content hash*
for every stored block, chained like the engine's:

``content(block) = H(content(parent), tokens, token_extra_ids, lora_id, mm_keys, cache_salt)``

Everything that changes a block's KV values (or isolates it) goes in, so two blocks whose KV
differ never share a content hash (up to 64-bit collisions): the parent's content hash (the
whole prefix), the token ids, the per-token extra ids, the LoRA id, the multimodal keys (hash
and start offset) and the cache salt. The salt is absorbed by the *first block of a prefix*
only (a block stored with ``parent_hash`` None): the rest of the prefix inherits it through
the chain, exactly as TensorRT-LLM seeds only its first block with the salt. A salt carried by
a later block is ignored.

The function ``H`` is kvevents' own 64-bit mixer ("kvh64"), defined here in plain Python and
implemented identically in the compiled core (``_indexcore``, which takes the constants below
from this module at import: they are defined here only); tests check they agree. It is
deterministic across processes and machines, so a router may compute content hashes itself
(:func:`content_hashes_for_tokens`) and query :meth:`CacheIndex.find_matches_by_content`.

kvh64 over a sequence of 64-bit words ``w``, from a start value ``h``::

    absorb(h, w) = x ^ (x >> 31)  where  x = ((h ^ w) * K1) mod 2**64
    finish(h)    = splitmix64-style finaliser (xor-shift 30, * K2, xor-shift 27, * K3, xor-shift 31)

``absorb`` is a bijection of ``h`` for a fixed word and of the word for a fixed ``h``, so two
inputs of equal length that differ in one word never collide. A block absorbs, in order:

1. the header word ``n_tokens | flags << 32 | n_mm_keys << 40`` (flags: 1 LoRA id present,
   2 extra ids present, 4 salt present, 8 multimodal keys present);
2. the LoRA id, when present;
3. the salt's own kvh64 (of its UTF-8 bytes, see :func:`salt_hash`), when present;
4. the token ids as unsigned 32-bit values, two per word (``t[2k] | t[2k+1] << 32``; an odd
   last token fills the low half alone);
5. when extra ids are present: their count, then each extra id (one word each; engines send
   one per token);
6. per multimodal key: its 32-byte hash as four little-endian words, then its start offset
   (as an unsigned 32-bit value);

then ``finish``. The start value is the parent's content hash, or :data:`ROOT_CONTENT_HASH`
for the first block of a prefix.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

from kvevents.schemas import WIDE_TOKEN_ID, KVCacheStoredBlockData, MmKey

__all__ = [
    "ROOT_CONTENT_HASH",
    "block_content_hash",
    "check_token_query",
    "content_hash_of_block",
    "content_hashes_for_tokens",
    "salt_hash",
]

_MASK = (1 << 64) - 1
_I32_MIN, _I32_MAX = -(1 << 31), (1 << 31) - 1
_U64_MAX = (1 << 64) - 1
K1 = 0x9E3779B97F4A7C15
K2 = 0xBF58476D1CE4E5B9
K3 = 0x94D049BB133111EB
ROOT_CONTENT_HASH = 0x6B766576656E7473
"""Start value of the first block of every prefix (the ASCII bytes of "kvevents")."""
SALT_SEED = 0x73616C7473616C74
"""Start value of :func:`salt_hash` (ASCII "saltsalt")."""

FLAG_LORA = 1
FLAG_EXTRA = 2
FLAG_SALT = 4
FLAG_MM = 8


def _absorb(h: int, w: int) -> int:
    x = ((h ^ w) * K1) & _MASK
    return x ^ (x >> 31)


def _finish(h: int) -> int:
    h ^= h >> 30
    h = (h * K2) & _MASK
    h ^= h >> 27
    h = (h * K3) & _MASK
    return h ^ (h >> 31)


def salt_hash(salt: str | bytes) -> int:
    """kvh64 of a cache salt: its byte length, then its UTF-8 bytes as zero-padded LE words."""
    data = salt.encode("utf-8") if isinstance(salt, str) else bytes(salt)
    h = _absorb(SALT_SEED, len(data))
    padded = data + b"\0" * (-len(data) % 8)
    for (word,) in struct.iter_unpack("<Q", padded):
        h = _absorb(h, word)
    return _finish(h)


def block_content_hash(
    parent_content: int | None,
    tokens: Sequence[int],
    lora_id: int | None = None,
    token_extra_ids: Sequence[int] | None = None,
    mm_keys: Sequence[MmKey] = (),
    cache_salt: str | bytes | None = None,
) -> int:
    """The content hash of one block whose parent's content hash is ``parent_content``.

    ``parent_content`` None means the block starts a prefix: the start value is
    :data:`ROOT_CONTENT_HASH` and ``cache_salt`` is absorbed; otherwise the salt is ignored.
    ``token_extra_ids`` that are all zero count as absent (the model's own convention).
    """
    n = len(tokens)
    extra = token_extra_ids if token_extra_ids is not None and any(token_extra_ids) else None
    salt = cache_salt if parent_content is None else None
    flags = (
        (FLAG_LORA if lora_id is not None else 0)
        | (FLAG_EXTRA if extra is not None else 0)
        | (FLAG_SALT if salt is not None else 0)
        | (FLAG_MM if mm_keys else 0)
    )
    h = ROOT_CONTENT_HASH if parent_content is None else parent_content
    h = _absorb(h, n | flags << 32 | len(mm_keys) << 40)
    if lora_id is not None:
        h = _absorb(h, lora_id & _MASK)
    if salt is not None:
        h = _absorb(h, salt_hash(salt))
    for i in range(0, n - 1, 2):
        h = _absorb(h, (tokens[i] & 0xFFFFFFFF) | (tokens[i + 1] & 0xFFFFFFFF) << 32)
    if n & 1:
        h = _absorb(h, tokens[n - 1] & 0xFFFFFFFF)
    if extra is not None:
        h = _absorb(h, len(extra))
        for x in extra:
            h = _absorb(h, x & _MASK)
    for key_hash, offset in mm_keys:
        if len(key_hash) != 32:
            raise ValueError(f"a multimodal key hash must be 32 bytes, got {len(key_hash)}")
        for (word,) in struct.iter_unpack("<Q", key_hash):
            h = _absorb(h, word)
        h = _absorb(h, offset & 0xFFFFFFFF)
    return _finish(h)


def content_hash_of_block(parent_content: int | None, block: KVCacheStoredBlockData) -> int:
    """:func:`block_content_hash` of a Stored event's block."""
    return block_content_hash(
        parent_content, block.tokens, block.lora_id, block.token_extra_ids, block.mm_keys, block.cache_salt
    )


def _widened(tokens: Sequence[int], extras: Sequence[int] | None) -> tuple[list[int], list[int]]:
    """Tokens past 32 bits as ``WIDE_TOKEN_ID``, their values moved to the extra ids."""
    ids = list(tokens)
    out = [0] * len(ids) if extras is None else list(extras)
    for i, t in enumerate(ids):
        if not _I32_MIN <= t <= _I32_MAX:
            if not -(1 << 63) <= t <= _MASK:
                raise ValueError(f"token {i} ({t}) does not fit in 64 bits")
            if out[i]:
                raise ValueError(f"token {i} is wider than 32 bits and has an extra id ({out[i]}) too")
            ids[i], out[i] = WIDE_TOKEN_ID, t & _MASK
    return ids, out


def check_token_query(
    lora_id: int | None, token_extra_ids: Sequence[int] | None, mm_keys: Sequence[Sequence[MmKey]] | None
) -> None:
    """ValueError naming a query argument outside what a stored block can carry (a LoRA id or an
    extra id outside 0..2**64-1, a multimodal offset outside int32), instead of hashing it
    wrapped: ``-1`` hashed as ``2**64 - 1``, ``2**64`` as 0."""
    if lora_id is not None and not 0 <= lora_id <= _U64_MAX:
        raise ValueError(f"lora_id {lora_id} is outside 0..2**64-1")
    if (
        token_extra_ids is not None
        and len(token_extra_ids)
        and not (min(token_extra_ids) >= 0 and max(token_extra_ids) <= _U64_MAX)
    ):
        bad = next(k for k, v in enumerate(token_extra_ids) if not 0 <= v <= _U64_MAX)
        raise ValueError(f"token_extra_ids[{bad}] {token_extra_ids[bad]} is outside 0..2**64-1")
    for b, keys in enumerate(mm_keys or ()):
        for k, (_, offset) in enumerate(keys):
            if not _I32_MIN <= offset <= _I32_MAX:
                raise ValueError(f"mm_keys[{b}][{k}] start offset {offset} is outside int32")


def content_hashes_for_tokens(
    tokens: Sequence[int],
    block_size: int,
    lora_id: int | None = None,
    *,
    cache_salt: str | None = None,
    token_extra_ids: Sequence[int] | None = None,
    mm_keys: Sequence[Sequence[MmKey]] | None = None,
) -> list[int]:
    """Chained content hashes of the full blocks of a token sequence (a trailing partial block
    is not hashed: engines store full blocks only).

    ``token_extra_ids`` (one per token) and ``mm_keys`` (one sequence per block, offsets relative
    to the block) must match what the engine reported for the blocks to be found. A token wider
    than 32 bits (SGLang's multimodal pad values) is hashed as the bridge stores it:
    ``WIDE_TOKEN_ID`` with its value as the token's extra id.
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    if token_extra_ids is not None and len(token_extra_ids) != len(tokens):
        raise ValueError(f"token_extra_ids has {len(token_extra_ids)} ids for {len(tokens)} tokens")
    check_token_query(lora_id, token_extra_ids, mm_keys)
    if any(not _I32_MIN <= t <= _I32_MAX for t in tokens):
        tokens, token_extra_ids = _widened(tokens, token_extra_ids)
    hashes: list[int] = []
    parent: int | None = None
    for b in range(len(tokens) // block_size):
        lo, hi = b * block_size, (b + 1) * block_size
        parent = block_content_hash(
            parent,
            tokens[lo:hi],
            lora_id,
            None if token_extra_ids is None else token_extra_ids[lo:hi],
            tuple(mm_keys[b]) if mm_keys is not None and b < len(mm_keys) else (),
            cache_salt,
        )
        hashes.append(parent)
    return hashes
