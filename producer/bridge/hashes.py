"""Engine values folded into kvevents' terms: block hashes, LoRA names, media.

- vLLM hashes: ints (the digest's last 8 bytes) or raw digests (bytes): a digest folds to its
  LAST 8 bytes big-endian, which equals vLLM's own int mode.
- SGLang hashes: signed int64 (a SHA-256's FIRST 8 bytes); a digest folds to its first 8 bytes.
- Every int folds to unsigned 64 bits (two's complement for negative values).
"""

from __future__ import annotations

import xxhash

from kvevents._brief import brief

__all__ = [
    "DEFAULT_MEDIUM_LEVELS",
    "MAX_MEDIA",
    "NEW_MEDIUM_LEVEL_MAX",
    "U64_MASK",
    "WireError",
    "fold_hash",
    "lora_id_for_name",
]

U64_MASK = (1 << 64) - 1

DEFAULT_MEDIUM_LEVELS: dict[str, int] = {
    "": 0,  # named but empty: the default medium, as no medium at all (Dynamo's router agrees)
    "GPU": 0,
    "CPU": 1,
    "CPU_PINNED": 1,
    "HOST": 1,
    "DISK": 2,
    "LOCAL_DISK": 2,
    "SSD": 2,
    "STORAGE": 2,
    "EXTERNAL": 3,
    "REMOTE": 3,
}
"""Engine ``medium`` -> kvevents ``cache_level`` (0 = GPU, the best tier; higher = slower)."""
NEW_MEDIUM_LEVEL_MAX = 15
"""The highest level a medium the bridge learns gets (the next after the highest known): the
index keeps levels 0..15 apart (``LEVEL_MAX``) and counts higher ones as 15."""
MAX_MEDIA = 64
"""Medium names a converter learns; a name past them takes ``NEW_MEDIUM_LEVEL_MAX`` unlearned
(a stream of ever new names made each one cost a scan of the learned ones, and levels, and the
tier map's masks, grow without bound)."""


class WireError(ValueError):
    """A value of an engine payload that cannot be interpreted (the message says which)."""


def fold_hash(value: object, *, take_last: bool, where: str) -> int:
    """An engine block hash (int of either sign, digest bytes, or a hex string) as a u64."""
    if isinstance(value, bool):
        raise WireError(f"{where}: a block hash must be an int or bytes, got a bool")
    if isinstance(value, int):
        if value < -(1 << 63) or value > U64_MASK:
            raise WireError(f"{where}: {brief(value)} does not fit in 64 bits")
        return value & U64_MASK
    if isinstance(value, str):
        try:
            value = bytes.fromhex(value.removeprefix("0x"))
        except ValueError:
            raise WireError(f"{where}: {value[:80]!r} is neither an int nor a hex digest") from None
    if isinstance(value, (bytes, bytearray, memoryview)):
        raw = bytes(value)
        if not raw:
            raise WireError(f"{where}: an empty byte string is not a block hash")
        part = raw[-8:] if take_last else raw[:8]
        return int.from_bytes(part, "big")
    raise WireError(f"{where}: a block hash must be an int or bytes, got {type(value).__name__}")


def lora_id_for_name(name: str) -> int:
    """A stable LoRA id for an adapter known only by name: xxh3-64 of its UTF-8 bytes, never 0."""
    value = xxhash.xxh3_64_intdigest(name.encode("utf-8", "surrogatepass"))
    return value or 1
