"""Checkpoint files: the format, atomic writes, clear errors, and restore == full replay."""

from __future__ import annotations

import os
from pathlib import Path

import msgspec
import pytest
from _index_helpers import batch, created, stored
from _index_model import TroubledProducer
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kvevents.consumer import CacheIndex, Checkpoint, CheckpointError, load_checkpoint, save_checkpoint
from kvevents.consumer._state import decode_state, encode_state
from kvevents.consumer.checkpoint import MAGIC, decode_checkpoint, encode_checkpoint
from kvevents.schemas import encode_batch


def sample_index() -> CacheIndex:
    index = CacheIndex()
    index.apply(batch([created(0), stored(1, [1, 2, 3]), stored(2, [4], parent=2)], 0))
    index.apply(batch([created(0, rank=1), stored(1, [1, 9], rank=1)], 0, instance="i1", dp=2))
    return index


def sample_checkpoint() -> Checkpoint:
    return Checkpoint(
        "kv-cache-events",
        {0: 12, 1: 0, 2: 7},
        sample_index().to_bytes(),
        created_at_us=123,
        kvevents_version="0.1.0",
    )


def test_round_trip_through_a_file(tmp_path: Path) -> None:
    checkpoint = sample_checkpoint()
    path = tmp_path / "index.ckpt"
    written = save_checkpoint(path, checkpoint)
    assert written == path.stat().st_size and path.read_bytes().startswith(MAGIC)
    loaded = load_checkpoint(path, topic="kv-cache-events")
    assert loaded == checkpoint and loaded.messages == 19
    assert loaded.index().same_state(sample_index())
    assert loaded.index(core="python").same_state(sample_index())
    assert [p.name for p in tmp_path.iterdir()] == ["index.ckpt"]  # no temporary file left


def test_a_failed_write_keeps_the_old_checkpoint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "index.ckpt"
    save_checkpoint(path, sample_checkpoint())
    before = path.read_bytes()

    def broken_replace(src: str, dst: str) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", broken_replace)
    newer = Checkpoint("kv-cache-events", {0: 99}, CacheIndex().to_bytes())
    with pytest.raises(OSError, match="disk full"):
        save_checkpoint(path, newer)
    assert path.read_bytes() == before and [p.name for p in tmp_path.iterdir()] == ["index.ckpt"]


def corrupt(data: bytes, at: int) -> bytes:
    return data[:at] + bytes([data[at] ^ 0x40]) + data[at + 1 :]


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda d: b"NOTACKPT" + d[8:], "not a kvevents checkpoint"),
        (lambda d: d[:8] + b"\x07\x00" + d[10:], "format version 7"),
        (lambda d: d[:5], "truncated"),
        (lambda d: d[: len(d) // 2], "truncated"),
        (lambda d: d + b"\x00", "truncated or padded"),
        (lambda d: corrupt(d, len(d) // 2), "checksum mismatch"),
        (lambda d: corrupt(d, len(d) - 1), "checksum mismatch"),
        (lambda d: d[:14] + b"\xc1" + d[15:], "corrupt header|checksum"),
    ],
)
def test_damaged_checkpoints_are_clear_errors(tmp_path: Path, damage, message: str) -> None:
    path = tmp_path / "bad.ckpt"
    path.write_bytes(damage(encode_checkpoint(sample_checkpoint())))
    with pytest.raises(CheckpointError, match=message) as info:
        load_checkpoint(path)
    assert str(path) in str(info.value)


def test_a_checkpoint_of_another_topic_or_no_file_is_a_clear_error(tmp_path: Path) -> None:
    path = tmp_path / "index.ckpt"
    save_checkpoint(path, sample_checkpoint())
    with pytest.raises(CheckpointError, match="topic 'kv-cache-events', not of 'other'"):
        load_checkpoint(path, topic="other")
    with pytest.raises(CheckpointError, match="no such checkpoint file"):
        load_checkpoint(tmp_path / "missing.ckpt")


def test_a_corrupt_index_state_with_a_valid_checksum_is_a_clear_error() -> None:
    checkpoint = Checkpoint("t", {0: 1}, b"KVIX\x01garbage")
    restored = decode_checkpoint(encode_checkpoint(checkpoint))
    with pytest.raises(CheckpointError, match="checkpoint of 't': corrupt index state"):
        restored.index()
    wrong_version = Checkpoint("t", {0: 1}, b"KVIX\x09")
    with pytest.raises(CheckpointError, match="unsupported index state format version 9"):
        decode_checkpoint(encode_checkpoint(wrong_version)).index()


@pytest.mark.parametrize("core", ["python", "compiled"])
def test_a_state_number_too_big_for_the_index_is_a_checkpoint_error_on_both_cores(core: str) -> None:
    """A cursor past int64 in a checksum-valid checkpoint: the compiled core let OverflowError
    escape ``Checkpoint.index()``, the pure one loaded it."""
    state = decode_state(sample_index().to_bytes())
    worker = msgspec.structs.replace(state.workers[0], cursor=2**64 - 1)
    bad = encode_state(msgspec.structs.replace(state, workers=[worker, *state.workers[1:]]))
    restored = decode_checkpoint(encode_checkpoint(Checkpoint("t", {0: 1}, bad)))
    with pytest.raises(CheckpointError, match=r"checkpoint of 't': corrupt index state: Expected `int` <= "):
        restored.index(core=core)


@settings(
    max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large]
)
@given(st.data())
def test_restoring_a_checkpoint_and_catching_up_equals_a_full_replay(data: st.DataObject) -> None:
    """Random troubled streams (drops, splits, replays, restarts, snapshots), a checkpoint at a
    random message, restored on a random core: catching up gives the full replay's state."""
    producer = TroubledProducer(data.draw, st)
    for _ in range(data.draw(st.integers(1, 60), label="steps")):
        producer.step()
    for name, inst in producer.instances.items():
        producer.flush(inst, name)
    messages = [encode_batch(b) for b in producer.delivered]
    full = CacheIndex()
    for m in messages:
        full.apply_encoded(m)
    cut = data.draw(st.integers(0, len(messages)), label="checkpoint after")
    before = CacheIndex(core=data.draw(st.sampled_from(["python", "compiled"]), label="writer core"))
    for m in messages[:cut]:
        before.apply_encoded(m)
    checkpoint = decode_checkpoint(encode_checkpoint(Checkpoint("t", {0: cut}, before.to_bytes())))
    restored = checkpoint.index(core=data.draw(st.sampled_from(["python", "compiled"]), label="reader core"))
    for m in messages[checkpoint.offsets[0] :]:
        restored.apply_encoded(m)
    assert restored.same_state(full)
    assert restored.degraded_workers() == full.degraded_workers()
