"""Replay anchors of ``kvevents export zmq``: positions a replay can re-read the topic from.

An anchor is (Kafka offsets, every stream's next seq there, the converter's state there); one is
taken at every checkpoint. Re-converting the topic from an anchor yields the very batches, seqs
and bytes published live. With a directory (``<state>.anchors/``), anchors are files kept
across restarts, so seqs published by earlier runs stay answerable; the exporter's first start
is the first anchor.

Which are kept: every anchor whose data is still retained (its offsets at or above the topic's
log start, so a replay from it reads no deleted batch), at most ``max_anchors`` and at most
``max_bytes`` of converter states (each holds every held block's tokens): above either the
anchor whose neighbours are closest together goes (the oldest and newest always stay), so
recent seqs are near an anchor and old ones still reachable, by a longer scan. A replay starts
from the newest retained anchor at or before the requested seq; a seq older than every retained
anchor is answered from the oldest one (as vLLM answers from what its buffer still has).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from .state import Anchor, load_anchor, save_anchor

__all__ = ["DEFAULT_MAX_BYTES", "AnchorStore"]

DEFAULT_MAX_BYTES = 1 << 30
"""Converter-state bytes kept across all anchors by default (memory, or disk with a directory)."""

log = logging.getLogger(__name__)


@dataclass
class _Entry:
    offsets: dict[int, int]
    seqs: dict[str, int]
    number: int
    converter: bytes | None  # in memory (no directory), else read from the file when used
    size: int  # the converter state's bytes (the file's, with a directory)


class AnchorStore:
    """Anchors oldest first, in memory or in ``directory`` (module docstring)."""

    def __init__(
        self, directory: Path | None, max_anchors: int = 64, max_bytes: int = DEFAULT_MAX_BYTES
    ) -> None:
        if max_anchors < 2:
            raise ValueError(f"max_anchors must be at least 2, got {max_anchors}")
        if max_bytes < 0:
            raise ValueError(f"max_bytes must not be negative, got {max_bytes}")
        self.directory = directory
        self.max_anchors = max_anchors
        self.max_bytes = max_bytes
        self._entries: list[_Entry] = []
        if directory is not None and directory.is_dir():
            for path in sorted(directory.glob("anchor-*.bin")):
                try:
                    anchor = load_anchor(path)
                except ValueError as exc:
                    log.warning("skipped a replay anchor: %s", exc)
                    continue
                number = int(path.stem.removeprefix("anchor-"))
                self._entries.append(_Entry(anchor.offsets, anchor.seqs, number, None, path.stat().st_size))
            found = len(self._entries)
            self._thin()
            if len(self._entries) < found:
                log.info(
                    "thinned %d replay anchors found in %s to the limits",
                    found - len(self._entries),
                    directory,
                )

    def __len__(self) -> int:
        return len(self._entries)

    def bytes_kept(self) -> int:
        """Converter-state bytes of the kept anchors (in memory, or their files)."""
        return sum(e.size for e in self._entries)

    def positions(self) -> list[dict[int, int]]:
        """Each kept anchor's offsets, oldest first."""
        return [dict(e.offsets) for e in self._entries]

    def _path(self, number: int) -> Path:
        assert self.directory is not None
        return self.directory / f"anchor-{number:012d}.bin"

    def add(self, anchor: Anchor) -> bool:
        """Keep ``anchor`` (not when it is where the newest one already is); thin to the limits."""
        if self._entries and self._entries[-1].offsets == anchor.offsets:
            return False
        number = self._entries[-1].number + 1 if self._entries else 0
        offsets, seqs = dict(anchor.offsets), dict(anchor.seqs)
        if self.directory is not None:
            save_anchor(self._path(number), anchor)
            size = self._path(number).stat().st_size
            self._entries.append(_Entry(offsets, seqs, number, None, size))
        else:
            self._entries.append(_Entry(offsets, seqs, number, anchor.converter, len(anchor.converter)))
        self._thin()
        return True

    def _thin(self) -> None:
        """Drop inner anchors until both limits hold (or only the oldest and newest are left)."""
        kept = self.bytes_kept()
        while len(self._entries) > 2 and (len(self._entries) > self.max_anchors or kept > self.max_bytes):
            kept -= self._drop(self._thinnest())
        if kept > self.max_bytes and len(self._entries) == 2:
            log.debug(
                "the oldest and newest replay anchors alone hold %d bytes (over %d)", kept, self.max_bytes
            )

    def _thinnest(self) -> int:
        """The inner anchor whose neighbours are closest together (by messages between them)."""

        def spread(i: int) -> int:
            before, after = self._entries[i - 1].offsets, self._entries[i + 1].offsets
            return sum(after.get(p, 0) - before.get(p, 0) for p in after)

        return min(range(1, len(self._entries) - 1), key=spread)

    def _drop(self, index: int) -> int:
        """Forget the anchor at ``index``; its bytes."""
        entry = self._entries.pop(index)
        if self.directory is not None:
            self._path(entry.number).unlink(missing_ok=True)
        return entry.size

    def clear(self) -> None:
        """Forget every anchor (and remove its file)."""
        while self._entries:
            self._drop(len(self._entries) - 1)

    def prune(self, log_start: Mapping[int, int]) -> int:
        """Forget the anchors whose data retention deleted (offsets below ``log_start``, the
        topic's low watermarks); how many went."""
        gone = [i for i, e in enumerate(self._entries) if not _retained(e.offsets, log_start)]
        for index in reversed(gone):
            self._drop(index)
        return len(gone)

    def choose(self, streams: Iterable[str], start_seq: int, log_start: Mapping[int, int]) -> Anchor | None:
        """The anchor to replay ``streams`` from ``start_seq``: the newest retained one at or
        before it, else the oldest retained one; None when none is retained."""
        keys = list(streams)
        retained = [e for e in self._entries if _retained(e.offsets, log_start)]
        if not retained:
            return None
        chosen = retained[0]
        for entry in reversed(retained):
            if all(entry.seqs.get(k, 0) <= start_seq for k in keys):
                chosen = entry
                break
        converter = chosen.converter
        if converter is None:
            converter = load_anchor(self._path(chosen.number)).converter
        return Anchor(dict(chosen.offsets), dict(chosen.seqs), converter)


def _retained(offsets: Mapping[int, int], log_start: Mapping[int, int]) -> bool:
    return all(offset >= log_start.get(p, 0) for p, offset in offsets.items())
