"""Liveness in checkpoints without Kafka: the round trip through the bytes (states and the
original clock kept), a checkpoint written before the field existed still loads (no liveness,
as before), and a reader of the old header ignores the new field."""

from __future__ import annotations

import struct
import time
from pathlib import Path

import msgspec
import pytest
import xxhash
from confluent_kafka import TIMESTAMP_CREATE_TIME, Message
from kvevents.consumer import CacheIndex, Checkpoint, LiveIndex, Liveness, load_checkpoint, save_checkpoint
from kvevents.consumer.checkpoint import FORMAT_VERSION, MAGIC, decode_checkpoint, encode_checkpoint
from kvevents.consumer.liveness import CONTROL_HEADER, Heard


def message(key: bytes, at_s: float, closing: bool = False) -> Message:
    headers = [(CONTROL_HEADER, b"close")] if closing else None
    return Message(
        topic="t", partition=0, offset=0, key=key, value=b"", headers=headers,
        timestamp=(TIMESTAMP_CREATE_TIME, int(at_s * 1000)),
    )  # fmt: skip


def tracked(now: float) -> Liveness:
    liveness = Liveness(10.0, clock=lambda: now)
    liveness.observe_message(message(b"live", now - 2.5))
    liveness.observe_message(message(b"silent", now - 60.125))
    liveness.observe_message(message(b"gone", now - 3.0))
    liveness.observe_message(message(b"gone", now - 1.0, closing=True))
    return liveness


def old_checkpoint_bytes(index_state: bytes) -> bytes:
    """A checkpoint as kvevents wrote it before liveness: the header has the five old fields."""
    header = msgspec.msgpack.encode(
        {"topic": "t", "offsets": {0: 5}, "created_at_us": 7, "index_bytes": len(index_state),
         "kvevents_version": "0.1.0"}
    )  # fmt: skip
    head = struct.pack("<8sHI", MAGIC, FORMAT_VERSION, len(header)) + header
    return head + index_state + xxhash.xxh3_128(head + index_state).digest()


def test_liveness_round_trips_through_a_checkpoint_file(tmp_path: Path) -> None:
    now = 1_700_000_000.0
    before = tracked(now)
    checkpoint = Checkpoint("t", {0: 4}, CacheIndex().to_bytes(), liveness=before.saved())
    save_checkpoint(tmp_path / "c.ckpt", checkpoint)
    loaded = load_checkpoint(tmp_path / "c.ckpt", topic="t")
    assert loaded == checkpoint
    assert loaded.liveness == {
        "live": Heard(now - 2.5, False),
        "silent": Heard(now - 60.125, False),
        "gone": Heard(now - 1.0, True),
    }
    later = now + 8.0  # restarted later: judged on the messages' clock, not the restart's
    after = Liveness(10.0, clock=lambda: later)
    after.restore(loaded.liveness)
    assert {i: after.state(i) for i in ("live", "silent", "gone")} == {
        "live": "stale", "silent": "stale", "gone": "closed"
    }  # fmt: skip
    assert {i: before.state(i, later) for i in ("live", "silent", "gone")} == {
        i: after.state(i) for i in ("live", "silent", "gone")
    }
    assert after.instance("silent").last_heard_s == before.instance("silent").last_heard_s
    after.observe_message(message(b"gone", later))  # a restarted instance is back, as before
    assert after.state("gone") == "live"


def test_a_live_index_restores_the_liveness_of_its_checkpoint() -> None:
    now = float(int(time.time()))  # whole seconds: Kafka timestamps are milliseconds
    checkpoint = decode_checkpoint(
        encode_checkpoint(Checkpoint("t", {0: 4}, CacheIndex().to_bytes(), liveness=tracked(now).saved()))
    )
    live = LiveIndex("127.0.0.1:1", "t", checkpoint=checkpoint, stale_after_s=10.0)  # not started
    assert live.liveness.not_routable(["live", "silent", "gone"]) == {"silent": "stale", "gone": "closed"}
    assert live.liveness.instance("silent").last_heard_s == now - 60.125
    shared = LiveIndex("127.0.0.1:1", "t", index=CacheIndex(), offsets={0: 4}, liveness=checkpoint.liveness)
    assert shared.liveness.saved() == checkpoint.liveness  # as route --serve hands it to each process
    with pytest.raises(ValueError, match="not both"):
        LiveIndex("127.0.0.1:1", "t", checkpoint=checkpoint, liveness=checkpoint.liveness)


def test_an_old_checkpoint_without_liveness_still_loads() -> None:
    index_state = CacheIndex().to_bytes()
    old = decode_checkpoint(old_checkpoint_bytes(index_state), topic="t")
    assert old == Checkpoint("t", {0: 5}, index_state, created_at_us=7, kvevents_version="0.1.0")
    assert old.liveness is None
    live = LiveIndex("127.0.0.1:1", "t", checkpoint=old, stale_after_s=10.0)  # as before: all unknown
    assert live.liveness.saved() == {} and live.liveness.state("anyone") == "live"


def test_a_reader_of_the_old_header_ignores_the_liveness_field() -> None:
    class OldHeader(msgspec.Struct):
        topic: str
        offsets: dict[int, int]
        created_at_us: int
        index_bytes: int
        kvevents_version: str = ""

    data = encode_checkpoint(Checkpoint("t", {0: 1}, b"x", liveness={"a": Heard(1.5, True)}))
    _magic, _version, length = struct.unpack_from("<8sHI", data)
    header = msgspec.msgpack.decode(data[14 : 14 + length], type=OldHeader)
    assert header.topic == "t" and header.index_bytes == 1
