"""Checkpoints: a ``CacheIndex`` saved together with the topic offsets it reflects.

Restored and caught up, a checkpoint gives the same index as a full replay. Kept in a file
(:func:`save_checkpoint` / :func:`load_checkpoint`: atomic rename) or a compacted Kafka topic
(:mod:`.checkpoint_kafka`). The format and its checks (:class:`CheckpointError` names what is
wrong): ``docs/INDEX.md``.
"""

from __future__ import annotations

import os
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec
import xxhash

from ._files import write_atomically
from .index import CacheIndex
from .liveness import DEFAULT_STALE_AFTER_S, Heard, Liveness, not_routable_workers, observe_liveness

if TYPE_CHECKING:
    from .reader import EventReader
    from .reader_metrics import ReaderProgress, ReadResult
    from .workers import WorkerKey

__all__ = [
    "FORMAT_VERSION",
    "MAGIC",
    "Checkpoint",
    "CheckpointError",
    "Restored",
    "decode_checkpoint",
    "encode_checkpoint",
    "load_checkpoint",
    "restore",
    "save_checkpoint",
]

MAGIC = b"KVEVCKPT"
FORMAT_VERSION = 1
_PREFIX = struct.Struct("<8sHI")  # magic, version, header length
_DIGEST_SIZE = 16


class CheckpointError(ValueError):
    """A checkpoint that cannot be used; the message says what is wrong with it."""


class _Header(msgspec.Struct, frozen=True):
    topic: str
    offsets: dict[int, int]
    created_at_us: int
    index_bytes: int
    kvevents_version: str = ""
    liveness: dict[str, Heard] | None = None  # absent in checkpoints older than liveness


def _package_version() -> str:
    try:
        return metadata.version("kvevents")
    except metadata.PackageNotFoundError:  # pragma: no cover - running from a source tree
        return "unknown"


@dataclass(frozen=True)
class Checkpoint:
    """An index state and the offsets it reflects: per partition of ``topic``, the next
    offset to read (every message before it is in the state). ``liveness``: per instance, when
    it was last heard and whether it closed, as of the same moment (None: not kept)."""

    topic: str
    offsets: dict[int, int]
    index_state: bytes = field(repr=False)
    created_at_us: int = 0
    kvevents_version: str = ""
    liveness: dict[str, Heard] | None = None

    @classmethod
    def capture(cls, index: CacheIndex, reader: EventReader, liveness: Liveness | None = None) -> Checkpoint:
        """The state of ``index`` (and ``liveness``, tracked from the same messages) and the
        offsets ``reader`` has applied to it. Call it between reads, from the thread that applies
        (they must describe the same moment). The reader must assign every partition (not a
        consumer group, whose members hold only some)."""
        if reader.group_id is not None:
            raise ValueError(
                "a checkpoint needs a reader of every partition, not a consumer group member "
                f"(group {reader.group_id!r})"
            )
        return cls(
            topic=reader.topic,
            offsets=reader.offsets(),
            index_state=index.to_bytes(),
            created_at_us=time.time_ns() // 1000,
            kvevents_version=_package_version(),
            liveness=None if liveness is None else liveness.saved(),
        )

    def index(self, *, core: str = "auto") -> CacheIndex:
        """The index this checkpoint holds (``CheckpointError`` if its state is corrupt)."""
        try:
            return CacheIndex.from_bytes(self.index_state, core=core)
        except (ValueError, OverflowError) as exc:  # decode_state checks ranges; OverflowError is a fence
            raise CheckpointError(f"checkpoint of {self.topic!r}: {exc}") from exc

    @property
    def messages(self) -> int:
        """Sum of the offsets: how many messages (of a topic never truncated) it reflects."""
        return sum(self.offsets.values())


def encode_checkpoint(checkpoint: Checkpoint) -> bytes:
    """The checkpoint's bytes (the format: ``docs/INDEX.md``)."""
    header = msgspec.msgpack.encode(
        _Header(
            checkpoint.topic,
            {int(p): int(o) for p, o in checkpoint.offsets.items()},
            checkpoint.created_at_us,
            len(checkpoint.index_state),
            checkpoint.kvevents_version,
            checkpoint.liveness,
        )
    )
    head = _PREFIX.pack(MAGIC, FORMAT_VERSION, len(header)) + header
    digest = xxhash.xxh3_128()
    digest.update(head)
    digest.update(checkpoint.index_state)
    return b"".join((head, checkpoint.index_state, digest.digest()))


def decode_checkpoint(
    data: bytes | bytearray | memoryview, *, topic: str | None = None, source: str = "checkpoint"
) -> Checkpoint:
    """Read :func:`encode_checkpoint`'s bytes; with ``topic``, also require that topic.
    ``source`` names where the bytes came from in error messages."""
    view = memoryview(data)
    if len(view) < _PREFIX.size:
        raise CheckpointError(f"{source}: truncated: {len(view)} bytes, not even a header")
    magic, version, header_len = _PREFIX.unpack_from(view)
    if magic != MAGIC:
        raise CheckpointError(
            f"{source}: not a kvevents checkpoint (starts with {bytes(magic)!r}, expected {MAGIC!r})"
        )
    if version != FORMAT_VERSION:
        raise CheckpointError(
            f"{source}: checkpoint format version {version}; this kvevents reads {FORMAT_VERSION}"
        )
    body_start = _PREFIX.size + header_len
    if len(view) < body_start + _DIGEST_SIZE:
        raise CheckpointError(
            f"{source}: truncated: {len(view)} bytes, the header alone needs {body_start + _DIGEST_SIZE}"
        )
    try:
        header = msgspec.msgpack.decode(view[_PREFIX.size : body_start], type=_Header)
    except msgspec.DecodeError as exc:
        raise CheckpointError(f"{source}: corrupt header ({exc})") from exc
    expected = body_start + header.index_bytes + _DIGEST_SIZE
    if len(view) != expected:
        raise CheckpointError(f"{source}: truncated or padded: {len(view)} bytes, the header says {expected}")
    digest = xxhash.xxh3_128(view[: expected - _DIGEST_SIZE]).digest()
    if digest != bytes(view[expected - _DIGEST_SIZE :]):
        raise CheckpointError(f"{source}: checksum mismatch: the checkpoint is corrupt")
    if topic is not None and header.topic != topic:
        raise CheckpointError(f"{source}: a checkpoint of topic {header.topic!r}, not of {topic!r}")
    return Checkpoint(
        topic=header.topic,
        offsets=dict(header.offsets),
        index_state=bytes(view[body_start : expected - _DIGEST_SIZE]),
        created_at_us=header.created_at_us,
        kvevents_version=header.kvevents_version,
        liveness=header.liveness,
    )


def save_checkpoint(path: str | os.PathLike[str], checkpoint: Checkpoint) -> int:
    """Write ``checkpoint`` to ``path`` atomically (temporary file, fsync, rename, fsync of the
    directory); returns the bytes written."""
    data = encode_checkpoint(checkpoint)
    write_atomically(Path(path), data)
    return len(data)


def load_checkpoint(path: str | os.PathLike[str], *, topic: str | None = None) -> Checkpoint:
    """Read a checkpoint file (``CheckpointError`` naming the file and what is wrong)."""
    try:
        data = Path(path).read_bytes()
    except FileNotFoundError:
        raise CheckpointError(f"{path}: no such checkpoint file") from None
    return decode_checkpoint(data, topic=topic, source=str(path))


@dataclass
class Restored:
    """What :func:`restore` made: the index, the reader positioned after the checkpoint (left
    open, to keep reading live), what catching up read (None without catching up), and the
    instances' liveness (the checkpoint's, then every message caught up; to keep it current
    while reading on, pass ``on_message=restored.observe`` to ``reader.apply_to``)."""

    index: CacheIndex
    reader: EventReader
    caught_up: ReadResult | None
    liveness: Liveness = field(default_factory=Liveness)

    def observe(self, message: Any) -> None:
        """Track one more message's liveness (closing instances leave the index, as while
        catching up): an ``on_message`` for ``reader.apply_to``."""
        observe_liveness(self.liveness, self.index, message)

    def not_routable(self, now: float | None = None) -> dict[WorkerKey, str]:
        """Workers routing must leave out now (stale or closed instance), with the state."""
        return not_routable_workers(self.index, self.liveness, now)


def restore(
    checkpoint: Checkpoint,
    bootstrap_servers: str,
    *,
    topic: str | None = None,
    core: str = "auto",
    catch_up: bool = True,
    progress: Callable[[ReaderProgress], None] | None = None,
    stale_after_s: float = DEFAULT_STALE_AFTER_S,
    **reader_options: Any,
) -> Restored:
    """The checkpoint's index, caught up with the topic: an :class:`EventReader` starts at the
    checkpoint's offsets (partitions it does not name, from the beginning) and applies
    everything up to the high watermarks captured when it starts. Liveness starts from the
    checkpoint's (when it has one) and tracks every message caught up, as :class:`LiveIndex`
    does: an instance that closes meanwhile leaves the index. The result equals a full replay of
    the topic up to those watermarks by the same rules (``kvevents index``'s, ``LiveIndex``'s).
    ``stale_after_s``: silence after which an instance is stale. ``reader_options`` go to the reader."""
    from .reader import EventReader

    name = topic or checkpoint.topic
    if name != checkpoint.topic:
        raise CheckpointError(f"a checkpoint of topic {checkpoint.topic!r}, not of {name!r}")
    index = checkpoint.index(core=core)
    liveness = Liveness(stale_after_s)
    if checkpoint.liveness is not None:
        liveness.restore(checkpoint.liveness)
    reader = EventReader(bootstrap_servers, name, start=checkpoint.offsets, **reader_options)
    restored = Restored(index, reader, None, liveness)
    try:
        if catch_up:
            restored.caught_up = reader.apply_to(index, progress=progress, on_message=restored.observe)
    except BaseException:
        reader.close()
        raise
    return restored
