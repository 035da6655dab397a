"""The ZMQ exporter's files: the restart state (where it is in the topic, each stream's next
seq, the converter's memory) and the replay anchors (:mod:`.anchors`).

Both are written atomically (temporary file + rename) as a magic prefix + msgpack. A restarted
exporter resumes at the saved offsets with the saved seqs, so every stream's seq continues
without a gap; what it published after the last save is published again with the same seqs (the
conversion is deterministic), which subscribers see as duplicates, never as a gap.
"""

from __future__ import annotations

from pathlib import Path

import msgspec

from .._files import write_atomically

__all__ = ["Anchor", "ExportState", "load_anchor", "load_state", "save_anchor", "save_state"]

MAGIC = b"KVXS2"
"""State files; ``KVXS1`` (before the anchors moved to their own files) is refused by name."""
ANCHOR_MAGIC = b"KVXA1"


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


_ENCODER = msgspec.msgpack.Encoder()
_STATE_DECODER = msgspec.msgpack.Decoder(ExportState)
_ANCHOR_DECODER = msgspec.msgpack.Decoder(Anchor)


def _write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomically(path, data)


def save_state(path: Path, state: ExportState) -> None:
    """Write ``state`` to ``path`` atomically."""
    _write(path, MAGIC + _ENCODER.encode(state))


def load_state(path: Path, topic: str) -> ExportState | None:
    """The state saved at ``path`` (None if there is no file); ValueError naming what is wrong."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    if data.startswith(b"KVXS1"):
        raise ValueError(
            f"{path} was written by an older kvevents (export state format 1, before replay "
            "anchors had their own files); remove it to start the streams' seqs from 0 again"
        )
    if not data.startswith(MAGIC):
        raise ValueError(f"{path} is not a kvevents export state file (starts with {data[:5]!r})")
    try:
        state = _STATE_DECODER.decode(data[len(MAGIC) :])
    except msgspec.DecodeError as exc:
        raise ValueError(f"{path}: corrupt export state: {exc}") from exc
    if state.topic != topic:
        raise ValueError(f"{path} is the state of topic {state.topic!r}, not {topic!r}")
    return state


def save_anchor(path: Path, anchor: Anchor) -> None:
    """Write one replay anchor atomically."""
    _write(path, ANCHOR_MAGIC + _ENCODER.encode(anchor))


def load_anchor(path: Path) -> Anchor:
    """A saved replay anchor; ValueError naming the file when it is not one or is corrupt."""
    data = path.read_bytes()
    if not data.startswith(ANCHOR_MAGIC):
        raise ValueError(f"{path} is not a kvevents replay anchor (starts with {data[:5]!r})")
    try:
        return _ANCHOR_DECODER.decode(data[len(ANCHOR_MAGIC) :])
    except msgspec.DecodeError as exc:
        raise ValueError(f"{path}: corrupt replay anchor: {exc}") from exc
