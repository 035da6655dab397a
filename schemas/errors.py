"""Errors of the wire contract."""

from __future__ import annotations

__all__ = ["DecodeError", "EncodeError", "LimitError"]


class DecodeError(ValueError):
    """Bytes that are not a valid kvevents message; the message says what was wrong."""


class LimitError(DecodeError):
    """A well-formed batch with a count or size beyond the consumer's limits
    (:class:`kvevents.schemas.limits.BatchLimits`); rejected like malformed bytes."""


class EncodeError(ValueError):
    """An event or batch that cannot be written, such as a block hash outside 0..2^64-1.

    The message starts with the path of the offending field when it is known, as in
    ``events[3].data.blocks[0].block_hash: -1 is outside the unsigned 64-bit range 0..2^64-1``.
    """

    def within(self, prefix: str) -> EncodeError:
        """This error with its field path extended by the enclosing record's path ``prefix``."""
        message = str(self)
        head = message.split(":", 1)[0]
        if head and " " not in head:
            return EncodeError(f"{prefix}.{message}")
        return EncodeError(f"{prefix}: {message}")
