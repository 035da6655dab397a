"""The ZMQ exporter's restart state: where it is in the topic, each stream's next seq, and the
converter's memory — plus the *anchor* it started from, which replays re-read the topic from.

Saved atomically (temporary file + rename) as ``MAGIC`` + msgpack. A restarted exporter resumes
at the saved offsets with the saved seqs, so every stream's seq continues without a gap; what it
published after the last save is published again with the same seqs (the conversion is
deterministic), which subscribers see as duplicates, never as a gap.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import msgspec

__all__ = ["Anchor", "ExportState", "load_state", "save_state"]

MAGIC = b"KVXS1"


class Anchor(msgspec.Struct):
    """A position a replay can start from: offsets, seqs there, converter state there."""

    offsets: dict[int, int]
    seqs: dict[str, int]
    converter: bytes


class ExportState(msgspec.Struct):
    """Everything a restarted exporter needs (``topic`` guards against the wrong file)."""

    topic: str
    offsets: dict[int, int]
    seqs: dict[str, int]
    converter: bytes
    anchor: Anchor


_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(ExportState)


def save_state(path: Path, state: ExportState) -> None:
    """Write ``state`` to ``path`` atomically."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(MAGIC + _ENCODER.encode(state))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def load_state(path: Path, topic: str) -> ExportState | None:
    """The state saved at ``path`` (None if there is no file); ValueError naming what is wrong."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    if not data.startswith(MAGIC):
        raise ValueError(f"{path} is not a kvevents export state file (starts with {data[:5]!r})")
    try:
        state = _DECODER.decode(data[len(MAGIC) :])
    except msgspec.DecodeError as exc:
        raise ValueError(f"{path}: corrupt export state: {exc}") from exc
    if state.topic != topic:
        raise ValueError(f"{path} is the state of topic {state.topic!r}, not {topic!r}")
    return state
