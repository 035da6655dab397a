"""The index's serialized state, shared by the compiled and the pure-Python core.

``MAGIC``, a format version byte, then a msgpack :class:`IndexState`: workers and window caches
("slots") numbered canonically, nodes sorted by hash as little-endian columns, holders packed
``slot | cache_level << 20 | priority << 24``. Equal logical states serialize to equal bytes
whichever core built them (``docs/INDEX.md``).
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Iterable
from typing import Annotated, TypeVar

import msgspec

_T = TypeVar("_T")

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


# The ranges a state's numbers may take: what the wire's limits let into an index
# (schemas/limits.py) and what the compiled core's records hold. A state beyond them is corrupt,
# and decoding says which field (rather than one core overflowing and the other loading it).
_Int32 = Annotated[int, msgspec.Meta(ge=0, le=(1 << 31) - 1)]
_Int64 = Annotated[int, msgspec.Meta(ge=0, le=(1 << 63) - 1)]
_Long = Annotated[int, msgspec.Meta(ge=-(1 << 63), le=(1 << 63) - 1)]
_U64 = Annotated[int, msgspec.Meta(ge=0)]  # msgpack holds no int above 2**64 - 1
_Reasons = Annotated[list[str], msgspec.Meta(max_length=MAX_REASONS)]


class WindowState(msgspec.Struct, array_like=True, frozen=True):
    """One (worker, window size) cache: the window size and its Created capacity, if any."""

    window_size: _Int32
    capacity: Annotated[list[_Int32], msgspec.Meta(max_length=LEVEL_MAX + 1)] | None


class WorkerState(msgspec.Struct, array_like=True, frozen=True):
    """A worker's replay cursor, split-event position and degraded status."""

    instance_id: str
    rank: _Int32
    cursor: _Int64 | None
    last_created: bool
    session_fresh: bool
    split_blocks: _Int64
    split_tail: _U64 | None
    degraded_reasons: _Reasons
    gaps: _Int64
    windows: list[WindowState]


class InstanceState(msgspec.Struct, array_like=True, frozen=True):
    """An engine instance's producer session: current id, last sequence, retired ids."""

    instance_id: str
    producer_id: _Long | None
    sequence: _Int64
    retired: list[_Long]
    attention_dp_size: Annotated[int, msgspec.Meta(ge=1, le=(1 << 31) - 1)]
    retired_sequences: list[_Int64] = []
    """The last sequence seen from each ``retired`` producer (format 2; format 1 lacks it, read
    as :data:`UNKNOWN_SEQUENCE`)."""
    pending_degraded: Annotated[list[tuple[str, _Int32]], msgspec.Meta(max_length=MAX_REASONS)] = []
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
        state = _DECODER.decode(view[5:])
    except msgspec.DecodeError as exc:
        raise ValueError(f"corrupt index state: {exc}") from exc
    _check_names(state)
    return state


def _check_names(state: IndexState) -> None:
    """Each instance, worker and worker's window named once (a repeated one would be restored
    twice over the same records: its blocks counted twice, and differently by each core)."""
    instances = [i.instance_id for i in state.instances]
    if len(set(instances)) != len(instances):
        raise ValueError(f"corrupt index state: instance {_first_repeat(instances)!r} appears twice")
    workers = [(w.instance_id, w.rank) for w in state.workers]
    if len(set(workers)) != len(workers):
        instance_id, rank = _first_repeat(workers)
        raise ValueError(f"corrupt index state: worker {instance_id!r} rank {rank} appears twice")
    for w in state.workers:
        windows = [win.window_size for win in w.windows]
        if len(set(windows)) != len(windows):
            raise ValueError(
                f"corrupt index state: worker {w.instance_id!r} rank {w.rank} has window size "
                f"{_first_repeat(windows)} twice"
            )


def _first_repeat(items: list[_T]) -> _T:
    seen: set[_T] = set()
    for item in items:
        if item in seen:
            return item
        seen.add(item)
    raise AssertionError("no repeat")
