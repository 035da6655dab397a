"""The ZMQ exporter's replay anchors (no broker): thinning keeps the oldest and newest and
spreads the rest, retention forgets anchors whose data went, the choice of anchor for a seq,
files kept across restarts, and the refusal of an older state file by name."""

from __future__ import annotations

from itertools import pairwise
from pathlib import Path

import pytest
from kvevents.consumer.export.anchors import AnchorStore
from kvevents.consumer.export.state import Anchor, ExportState, load_state, save_state
from kvevents.consumer.export.zmq_export import Endpoint, ZmqExportConfig, ZmqExporter

S = "0:kv@a@m"


def _anchor(offset: int, seq: int) -> Anchor:
    return Anchor({0: offset}, {S: seq}, f"state@{offset}".encode())


def test_thinning_keeps_the_ends_and_spreads_the_rest() -> None:
    store = AnchorStore(None, max_anchors=4)
    for offset in range(0, 100, 10):
        assert store.add(_anchor(offset, offset // 2))
    assert not store.add(_anchor(90, 45))  # where the newest already is
    kept = [p[0] for p in store.positions()]
    assert len(kept) == 4 and kept[0] == 0 and kept[-1] == 90
    assert max(b - a for a, b in pairwise(kept)) <= 40


def test_choice_and_retention() -> None:
    store = AnchorStore(None, max_anchors=10)
    for offset, seq in ((0, 0), (10, 4), (20, 9), (30, 15)):
        store.add(_anchor(offset, seq))
    chosen = store.choose([S], 10, {0: 0})
    assert chosen is not None and chosen.offsets == {0: 20} and chosen.converter == b"state@20"
    assert store.choose([S], 3, {0: 0}).offsets == {0: 0}  # type: ignore[union-attr]
    # retention deleted offsets 0..14: the first two anchors cannot be replayed from any more
    chosen = store.choose([S], 3, {0: 15})
    assert chosen is not None and chosen.offsets == {0: 20}  # the oldest retained answers
    assert store.prune({0: 15}) == 2 and [p[0] for p in store.positions()] == [20, 30]
    assert store.choose([S], 3, {0: 31}) is None


def test_files_survive_a_restart(tmp_path: Path) -> None:
    directory = tmp_path / "export.state.anchors"
    store = AnchorStore(directory, max_anchors=3)
    for offset in (0, 10, 20, 30):
        store.add(_anchor(offset, offset))
    assert len(list(directory.glob("anchor-*.bin"))) == 3
    again = AnchorStore(directory, max_anchors=3)
    assert again.positions() == store.positions()
    assert again.choose([S], 25, {0: 0}).converter == b"state@20"  # type: ignore[union-attr]
    (directory / "anchor-999999999999.bin").write_bytes(b"junk")
    assert len(AnchorStore(directory, max_anchors=3)) == 3  # a bad file is skipped (logged)
    again.clear()
    assert not list(directory.glob("anchor-0*.bin")) and not len(AnchorStore(directory, max_anchors=3))


def test_an_older_state_file_is_refused_by_name(tmp_path: Path) -> None:
    path = tmp_path / "export.state"
    path.write_bytes(b"KVXS1" + b"\x80")
    with pytest.raises(ValueError, match="older kvevents"):
        load_state(path, "t")


def test_anchors_are_thinned_to_their_bytes_keeping_the_oldest_and_newest(tmp_path: Path) -> None:
    """Each anchor holds the converter's whole state (every held block's tokens): the store keeps
    at most ``max_bytes`` of them, in memory or on disk, dropping inner anchors first."""
    for directory in (None, tmp_path / "anchors"):
        store = AnchorStore(directory, max_anchors=64, max_bytes=10_000)
        for i in range(20):
            store.add(Anchor({0: i * 10}, {"s": i}, bytes(3_000)))
            assert store.bytes_kept() <= 10_000 or len(store) == 2
        assert len(store) == 3 and store.bytes_kept() <= 10_000
        positions = store.positions()
        assert positions[0] == {0: 0} and positions[-1] == {0: 190}  # the ends stay
        if directory is not None:
            assert len(list(directory.glob("anchor-*.bin"))) == 3
            assert sum(p.stat().st_size for p in directory.glob("anchor-*.bin")) == store.bytes_kept()
        big = AnchorStore(None, max_anchors=64, max_bytes=100)
        for i in range(5):
            big.add(Anchor({0: i}, {}, bytes(1_000)))
        assert big.positions() == [{0: 0}, {0: 4}]  # over the bytes with two: both stay


def test_a_lower_byte_limit_thins_anchors_kept_on_disk_at_start(tmp_path: Path) -> None:
    directory = tmp_path / "anchors"
    store = AnchorStore(directory, max_anchors=10)
    for i in range(6):
        store.add(Anchor({0: i}, {"s": i}, bytes(2_000)))
    per_file = store.bytes_kept() // 6
    again = AnchorStore(directory, max_anchors=10, max_bytes=3 * per_file)
    assert len(again) == 3 and again.positions()[0] == {0: 0} and again.positions()[-1] == {0: 5}
    assert len(list(directory.glob("anchor-*.bin"))) == 3


def test_a_state_file_with_a_damaged_converter_state_is_refused_by_name(tmp_path: Path) -> None:
    """The state file's envelope decodes, its converter blob does not: a ValueError naming the
    file (the CLI prints it), not msgspec's message alone."""
    path = tmp_path / "export.state"
    save_state(path, ExportState("t", {0: 5}, {S: 3}, b"\x93not a converter"))
    config = ZmqExportConfig("127.0.0.1:1", "t", pub=Endpoint("tcp://127.0.0.1:0", True), state_path=path)
    with pytest.raises(ValueError, match="corrupt converter state") as caught:
        ZmqExporter(config)
    assert str(path) in str(caught.value)
