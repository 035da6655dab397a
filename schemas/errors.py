"""Errors of the wire contract."""

from __future__ import annotations

__all__ = ["DecodeError", "EncodeError"]


class DecodeError(ValueError):
    """Bytes that are not a valid kvevents message; the message says what was wrong."""


class EncodeError(ValueError):
    """An event or batch that cannot be written, such as a block hash outside 0..2^64-1."""
