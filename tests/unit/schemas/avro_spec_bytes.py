"""Avro binary values written out from the specification, to check the codecs against."""

from __future__ import annotations

__all__ = ["ENVELOPE_DEFAULTS", "zz"]


def zz(n: int) -> bytes:
    """Avro's zigzag varint of the long ``n``."""
    z = ((n << 1) ^ (n >> 63)) & ((1 << 64) - 1)
    out = bytearray()
    while z >= 0x80:
        out.append(z & 0x7F | 0x80)
        z >>= 7
    out.append(z)
    return bytes(out)


ENVELOPE_DEFAULTS = zz(1) + zz(0) + zz(0) + zz(0) + zz(0) + zz(0)
"""EventBatch from attention_dp_size to first_event_block_offset at their defaults, no drops."""
