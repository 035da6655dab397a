"""A multimodal item's 32-byte key (``KVCacheStoredBlockData.mm_keys``) from the text an engine
sends for it: a hex digest as its bytes; any other identifier (a user-given UUID, an identifier
with a LoRA prefix) as its UTF-8 bytes zero-padded to 32, or their SHA-256 when longer, the
rule TensorRT-LLM's ``uuid_to_hash`` follows for UUIDs."""

from __future__ import annotations

import hashlib

__all__ = ["digest_from_hex", "mm_key_from_text"]

_HEX_DIGITS = frozenset("0123456789abcdefABCDEF")


def digest_from_hex(text: str) -> bytes | None:
    """The 32 bytes of a 64-digit hex digest (``0x`` allowed before it); None for other text."""
    digest = text[2:] if text.startswith("0x") else text
    if len(digest) == 64 and _HEX_DIGITS.issuperset(digest):
        return bytes.fromhex(digest)
    return None


def mm_key_from_text(text: str) -> bytes:
    """The key of ``text``; UnicodeEncodeError if it is not UTF-8 text (a lone surrogate)."""
    digest = digest_from_hex(text)
    if digest is not None:
        return digest
    raw = text.encode()
    return raw.ljust(32, b"\0") if len(raw) <= 32 else hashlib.sha256(raw).digest()
