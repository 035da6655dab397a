"""The Parquet layout of an export directory, and how an export resumes without duplicates.

Layout (hive style, readable by pyarrow, DuckDB, Spark)::

    DIR/date=YYYY-MM-DD/instance=NAME/part-CCCCCCCC.parquet   one file per chunk and partition
    DIR/_kvevents_export.json                                  state: topic, next offsets, next chunk
    DIR/_malformed.jsonl                                       messages set aside (one JSON line each)

A chunk's files are written under dot-names (ignored by readers), closed, renamed into place;
only then the state file is replaced (atomically) with the offsets after the chunk and
``next_chunk`` + 1. A run killed between the two leaves files of a chunk the state does not
count: the next run deletes every ``part-C`` with ``C >= next_chunk`` before it writes, and
reads again from the state's offsets, so nothing is lost or written twice.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pyarrow as pa
import pyarrow.parquet as pq

__all__ = [
    "STATE_FILE",
    "ExportState",
    "ParquetSink",
    "PartitionNameError",
    "check_instance_folder",
    "partition_dir",
]

log = logging.getLogger(__name__)

STATE_FILE = "_kvevents_export.json"
MALFORMED_FILE = "_malformed.jsonl"
_PART = re.compile(r"^part-(\d{8})\.parquet$")
_STATE_VERSION = 1


def partition_dir(root: Path, date: str, instance: str) -> Path:
    """``root/date=.../instance=...`` with the instance percent-encoded as Hive/Spark escape it."""
    return root / f"date={date}" / _instance_folder(instance)


def _instance_folder(instance: str) -> str:
    return f"instance={quote(instance, safe=' -_.~@+,;!$&()')}"


class PartitionNameError(ValueError):
    """An instance id whose partition folder name no file system takes."""


MAX_FOLDER_BYTES = 255
"""A file name's limit on the file systems an export is written to (ext4, XFS, APFS, NTFS)."""


def check_instance_folder(instance: str) -> None:
    """PartitionNameError when ``instance``'s folder name is longer than ``MAX_FOLDER_BYTES``
    (percent-encoding makes a 256-byte id up to 768 bytes): the export sets such a batch aside,
    as a malformed message, instead of stopping on ``OSError`` at every restart."""
    size = len(_instance_folder(instance).encode("utf-8"))
    if size > MAX_FOLDER_BYTES:
        raise PartitionNameError(
            f"instance id {instance[:40]!r}... makes a {size}-byte partition folder name, over the "
            f"{MAX_FOLDER_BYTES} bytes file systems take"
        )


@dataclass
class ExportState:
    """What an export directory has: the topic, per partition the next offset, the next chunk."""

    topic: str
    offsets: dict[int, int] = field(default_factory=dict)
    next_chunk: int = 0
    rows: int = 0
    messages: int = 0
    malformed: int = 0

    @classmethod
    def load(cls, root: Path, topic: str) -> ExportState:
        """The state in ``root`` (a fresh one when there is none); a different topic is an error."""
        path = root / STATE_FILE
        if not path.exists():
            return cls(topic)
        try:
            data = json.loads(path.read_text())
            state = cls(
                topic=str(data["topic"]),
                offsets={int(p): int(o) for p, o in data["offsets"].items()},
                next_chunk=int(data["next_chunk"]),
                rows=int(data.get("rows", 0)),
                messages=int(data.get("messages", 0)),
                malformed=int(data.get("malformed", 0)),
            )
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"{path}: not a kvevents export state file ({exc})") from exc
        if state.topic != topic:
            raise ValueError(
                f"{root} holds an export of topic {state.topic!r}, not {topic!r}: use another directory"
            )
        return state

    def save(self, root: Path) -> None:
        """Replace the state file atomically (write, fsync, rename)."""
        path = root / STATE_FILE
        tmp = root / f".{STATE_FILE}.tmp"
        data = {
            "version": _STATE_VERSION,
            "topic": self.topic,
            "offsets": {str(p): o for p, o in sorted(self.offsets.items())},
            "next_chunk": self.next_chunk,
            "rows": self.rows,
            "messages": self.messages,
            "malformed": self.malformed,
        }
        with open(tmp, "w") as f:
            json.dump(data, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)


class ParquetSink:
    """Writes chunks of rows into an export directory and keeps its state (see the module)."""

    def __init__(self, root: Path, topic: str, *, compression: str = "zstd") -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        self.state = ExportState.load(root, topic)
        self.compression = compression
        self.removed_leftovers = self._remove_leftovers()

    def _remove_leftovers(self) -> int:
        """Delete files of chunks the state does not count (a run killed mid-chunk); how many."""
        removed = 0
        for path in self.root.rglob("*"):
            if not path.is_file():
                continue
            match = _PART.match(path.name)
            leftover = (match is not None and int(match.group(1)) >= self.state.next_chunk) or (
                path.name.startswith(".part-") and path.name.endswith(".tmp")
            )
            if leftover:
                log.warning("removing %s: written by an export that stopped before saving its state", path)
                path.unlink()
                removed += 1
        return removed

    def write_chunk(
        self,
        tables: Mapping[tuple[str, str], pa.Table],
        offsets: Mapping[int, int],
        *,
        messages: int,
        malformed: list[dict[str, Any]],
    ) -> int:
        """Write one chunk: a table per (date, instance), then the state with ``offsets`` (the
        next offset per partition after the chunk). Returns the rows written."""
        state = self.state
        chunk = state.next_chunk
        written: list[tuple[Path, Path]] = []
        rows = 0
        for (date, instance), table in sorted(tables.items()):
            if table.num_rows == 0:
                continue
            directory = partition_dir(self.root, date, instance)
            directory.mkdir(parents=True, exist_ok=True)
            final = directory / f"part-{chunk:08d}.parquet"
            tmp = directory / f".part-{chunk:08d}.parquet.tmp"
            pq.write_table(table, tmp, compression=self.compression)
            written.append((tmp, final))
            rows += table.num_rows
        for tmp, final in written:
            os.replace(tmp, final)
        if malformed:
            with open(self.root / MALFORMED_FILE, "a") as f:
                for entry in malformed:
                    f.write(json.dumps(entry) + "\n")
        state.offsets.update(offsets)
        state.next_chunk = chunk + 1
        state.rows += rows
        state.messages += messages
        state.malformed += len(malformed)
        state.save(self.root)
        return rows
