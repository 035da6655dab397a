"""How a reader hands messages of either framing to an index.

Without a codec every message goes to ``CacheIndex.apply_encoded`` (single-object framing; the
compiled core reads the body in place). With a codec (a schema registry), single-object
messages still go there; a Confluent-framed message written with the current schema is
re-framed as single-object (a header swap, one copy) and takes the same fast path; any other
is decoded by the codec and applied as a batch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from kvevents.schemas import DecodeError, EventBatch

if TYPE_CHECKING:
    from .index import CacheIndex

__all__ = ["BatchDecoder", "index_applier"]

_SINGLE_OBJECT_FIRST_BYTE = 0xC3


class BatchDecoder(Protocol):
    """What :class:`~kvevents.consumer.EventReader` needs of a codec."""

    def decode_batch(self, data: bytes | bytearray | memoryview) -> EventBatch: ...


def index_applier(index: CacheIndex, codec: BatchDecoder | None) -> Callable[[Any], None]:
    """A function applying one message value to ``index``; DecodeError if it is malformed."""
    apply_encoded = index.apply_encoded
    if codec is None:
        return apply_encoded
    reframe: Callable[[Any], bytes | None] | None = getattr(codec, "as_single_object", None)
    decode = codec.decode_batch
    apply_batch = index.apply

    def apply(value: Any) -> None:
        if value is None:
            raise DecodeError("empty message (a tombstone?)")
        if len(value) and value[0] == _SINGLE_OBJECT_FIRST_BYTE:
            apply_encoded(value)
            return
        if reframe is not None:
            framed = reframe(value)
            if framed is not None:
                apply_encoded(framed)
                return
        apply_batch(decode(value))

    return apply
