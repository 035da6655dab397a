"""``write_atomically``, behind checkpoints and the ZMQ exporter's state: the new bytes or the old
file, no temporary file left behind either way."""

from __future__ import annotations

from pathlib import Path

import pytest
from kvevents.consumer._files import write_atomically


def test_it_replaces_the_file_and_leaves_nothing_else(tmp_path: Path) -> None:
    target = tmp_path / "state.bin"
    target.write_bytes(b"old")
    write_atomically(target, b"new bytes")
    assert target.read_bytes() == b"new bytes"
    assert [p.name for p in tmp_path.iterdir()] == ["state.bin"]


def test_a_failed_write_keeps_the_old_file_and_removes_its_temporary(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    target = tmp_path / "state.bin"
    target.write_bytes(b"old")

    def no_rename(src: str, dst: object) -> None:
        raise OSError("rename refused")

    monkeypatch.setattr("kvevents.consumer._files.os.replace", no_rename)
    with pytest.raises(OSError, match="rename refused"):
        write_atomically(target, b"new")
    assert target.read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["state.bin"]
