"""The index's serialized state, shared by the compiled and the pure-Python core.

``MAGIC``, a format version byte, then a msgpack :class:`IndexState`: workers and window caches
("slots") numbered canonically, nodes sorted by hash as little-endian columns, holders packed
``slot | cache_level << 20 | priority << 24``. Equal logical states serialize to equal bytes
whichever core built them (``docs/INDEX.md``).
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Iterable

import msgspec

_join: Callable[[Iterable[bytes]], bytes]
try:
    from ._statejoin import join_released as _join
except ImportError:  # not built: the columns are copied holding the GIL
    _join = b"".join

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
FORMAT_VERSION = 3
READABLE_VERSIONS = (1, 2, 3)
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
    pending_degraded: list[tuple[str, int]] = []
    """Degradations of every rank below ``n`` that wait for ranks not seen yet: ``(reason, n)``
    (format 3; the formats before made a worker for every such rank instead)."""


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


_FIELD_KEYS = [(name, _ENCODER.encode(name)) for name in IndexState.__struct_fields__]
_MAP_HEADER = (
    bytes([0x80 | len(_FIELD_KEYS)]) if len(_FIELD_KEYS) < 16 else struct.pack(">BH", 0xDE, len(_FIELD_KEYS))
)


def _bin_header(size: int) -> bytes:
    """msgpack's header of a ``size``-byte bin (the smallest of bin 8/16/32, as msgspec)."""
    if size < 1 << 8:
        return struct.pack(">BB", 0xC4, size)
    if size < 1 << 16:
        return struct.pack(">BH", 0xC5, size)
    return struct.pack(">BI", 0xC6, size)


def encode_state(state: IndexState) -> bytes:
    """``MAGIC`` + version + msgpack of ``state``: the bytes ``_ENCODER.encode(state)`` gives,
    assembled from the map's small parts and the columns as they are, copied once into the
    result (without the GIL when the compiled ``_statejoin`` is built: at 256 x 100k the
    columns are ~470 MB, and encoding then prefixing them held the GIL 0.6 s)."""
    parts = [MAGIC, bytes([FORMAT_VERSION]), _MAP_HEADER]
    for name, key in _FIELD_KEYS:
        value = getattr(state, name)
        parts.append(key)
        if isinstance(value, bytes):
            parts += (_bin_header(len(value)), value)
        else:
            parts.append(_ENCODER.encode(value))
    return _join(parts)


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
