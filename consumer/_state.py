"""The index's serialized state, shared by the compiled and the pure-Python core.

``MAGIC``, a format version byte, then a msgpack :class:`IndexState`: workers and window caches
("slots") numbered canonically, nodes sorted by hash as little-endian columns, holders packed
``slot | cache_level << 20 | priority << 24``. Equal logical states serialize to equal bytes
whichever core built them (``docs/INDEX.md``).
"""

from __future__ import annotations

import msgspec

__all__ = [
    "FORMAT_VERSION",
    "LEVEL_MAX",
    "MAGIC",
    "MAX_REASONS",
    "PRIORITY_MAX",
    "SLOT_BITS",
    "SLOT_MAX",
    "UNKNOWN_SEQUENCE",
    "IndexState",
    "InstanceState",
    "WindowState",
    "WorkerState",
    "decode_state",
    "encode_state",
]

MAGIC = b"KVIX"
FORMAT_VERSION = 2
READABLE_VERSIONS = (1, 2)
"""Format 1 had no ``InstanceState.retired_sequences``."""
UNKNOWN_SEQUENCE = (1 << 63) - 1
"""The last sequence of a retired producer restored from format 1: none of its batches is new."""
SLOT_BITS = 20
SLOT_MAX = (1 << SLOT_BITS) - 1
"""At most 2**20 - 1 (worker, window size) caches in one index."""
LEVEL_MAX = 15
"""Cache levels above this are saturated to it (TensorRT-LLM uses 0 and 1)."""
PRIORITY_MAX = 255
"""Priorities are saturated to 0..255 (TensorRT-LLM uses 0..100)."""
MAX_REASONS = 8
"""A degraded worker keeps its first reasons; later gaps are only counted."""


class WindowState(msgspec.Struct, array_like=True, frozen=True):
    """One (worker, window size) cache: the window size and its Created capacity, if any."""

    window_size: int
    capacity: list[int] | None


class WorkerState(msgspec.Struct, array_like=True, frozen=True):
    """A worker's replay cursor, split-event position and degraded status."""

    instance_id: str
    rank: int
    cursor: int | None
    last_created: bool
    session_fresh: bool
    split_blocks: int
    split_tail: int | None
    degraded_reasons: list[str]
    gaps: int
    windows: list[WindowState]


class InstanceState(msgspec.Struct, array_like=True, frozen=True):
    """An engine instance's producer session: current id, last sequence, retired ids."""

    instance_id: str
    producer_id: int | None
    sequence: int
    retired: list[int]
    attention_dp_size: int
    retired_sequences: list[int] = []
    """The last sequence seen from each ``retired`` producer (format 2; format 1 lacks it, read
    as :data:`UNKNOWN_SEQUENCE`)."""


class IndexState(msgspec.Struct, frozen=True):
    """The whole index: sessions, workers and the held blocks as columns."""

    instances: list[InstanceState]
    workers: list[WorkerState]
    engine: bytes
    """u64 engine block hashes, ascending."""
    content: bytes
    """u64 content hash per node (0 where ``has_content`` is 0)."""
    has_content: bytes
    """u8 per node: 1 when the node's content hash is known, 0 for an orphan."""
    holder_counts: bytes
    """u32 per node: how many holders it has (at least 1)."""
    holders: bytes
    """u32 packed holders, node after node, each node's sorted by slot."""


_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(IndexState)


def encode_state(state: IndexState) -> bytes:
    """``MAGIC`` + version + msgpack of ``state``."""
    return MAGIC + bytes([FORMAT_VERSION]) + _ENCODER.encode(state)


def decode_state(data: bytes | bytearray | memoryview) -> IndexState:
    """Read what :func:`encode_state` wrote; ValueError naming what is wrong otherwise."""
    view = memoryview(data)
    if bytes(view[:4]) != MAGIC:
        raise ValueError(f"not a kvevents index state: starts with {bytes(view[:4])!r}, expected {MAGIC!r}")
    if len(view) < 5 or view[4] not in READABLE_VERSIONS:
        got = view[4] if len(view) >= 5 else "nothing"
        raise ValueError(
            f"unsupported index state format version {got}; this reader knows {', '.join(map(str, READABLE_VERSIONS))}"
        )
    try:
        return _DECODER.decode(view[5:])
    except msgspec.DecodeError as exc:
        raise ValueError(f"corrupt index state: {exc}") from exc
