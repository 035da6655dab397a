"""Hostile inputs: whatever bytes or msgpack shapes arrive (nested past any decoder's depth too),
the converter returns events or raises BridgeDecodeError (a DecodeError) and keeps its state;
event_from_trtllm raises TrtllmDecodeError with a short message; a damaged state file is named."""

from __future__ import annotations

import contextlib
import re
import struct
import tracemalloc
from pathlib import Path

import msgspec
import pytest
from deep_values import nested_list
from hypothesis import given, settings
from hypothesis import strategies as st
from kvevents.producer.bridge import BridgeDecodeError, ZmqEventConverter
from kvevents.producer.bridge.live import ZmqBridge
from kvevents.producer.bridge.state import STATE_VERSION, load_state, save_state
from kvevents.producer.bridge.tiers import TierMap
from kvevents.producer.sink_encoded import EncodedEvents
from kvevents.producer.trtllm import TrtllmDecodeError, event_from_trtllm

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**63), 2**64 - 1),
    st.floats(allow_nan=False),
    st.text(max_size=8),
    st.binary(max_size=40),
    st.sampled_from(["BlockStored", "BlockRemoved", "AllBlocksCleared", "GPU", "CPU"]),
)
values = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=6),
        st.dictionaries(
            st.sampled_from(
                ["type", "block_hashes", "token_ids", "block_size", "medium", "events", "ts", "x"]
            ),
            inner,
            max_size=6,
        ),
    ),
    max_leaves=30,
)
stored_like = st.builds(
    lambda h, p, t, b, rest: ["BlockStored", h, p, t, b, *rest],
    st.lists(st.one_of(st.integers(-(2**63), 2**64 - 1), st.binary(max_size=33)), max_size=4),
    st.one_of(st.none(), st.integers(-5, 5), st.binary(max_size=32)),
    st.lists(st.integers(-(2**32), 2**32), max_size=12),
    st.integers(-2, 6),
    st.lists(values, max_size=8),
)


@settings(max_examples=200, deadline=None)
@given(st.one_of(st.binary(max_size=64), values.map(msgspec.msgpack.encode)))
def test_random_payloads_never_crash(payload: bytes) -> None:
    conv = ZmqEventConverter("vllm")
    with contextlib.suppress(BridgeDecodeError):
        conv.convert(payload)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.one_of(stored_like, values), max_size=4), st.sampled_from(["vllm", "sglang"]))
def test_event_like_payloads_never_crash_and_keep_state_on_error(events: list, engine: str) -> None:
    conv = ZmqEventConverter(engine)
    conv.convert(msgspec.msgpack.encode([0.0, [["BlockStored", [1], None, [1], 1, None, "GPU"]]]))
    before = conv.to_state()
    try:
        conv.convert(msgspec.msgpack.encode([0.0, events]))
    except BridgeDecodeError:
        assert conv.to_state() == before


@settings(max_examples=150, deadline=None)
@given(
    st.dictionaries(
        st.sampled_from(["event_id", "data", "window_size", "attention_dp_rank"]), values, max_size=4
    )
)
def test_random_trtllm_dicts_never_crash(d: dict) -> None:
    with contextlib.suppress(TrtllmDecodeError):
        event_from_trtllm(d)


TS = b"\xcb" + struct.pack(">d", 1.5)
STORED_HEAD = b"\xab" + b"BlockStored" + b"\x91\x01\xc0"  # tag, [1] hashes, no parent
FORGED_COUNTS = {  # an array or map header claiming far more items than the bytes that follow
    "events array32": b"\x93" + TS + b"\xdd\xff\xff\xff\xff\x90",
    "found by mutation fuzzing": bytes.fromhex("93cb3ff8000000008f17dde600009191b0"),
    "top-level map32": b"\xdf\xff\xff\xff\xff\xa2ts" + TS,
    "event map16": b"\x92" + TS + b"\x91\xde\xff\xff\xa4type",
    "tokens array32": b"\x92" + TS + b"\x91\x97" + STORED_HEAD + b"\xdd\x7f\xff\xff\xff\x01\x01",
    "hashes array32": b"\x92" + TS + b"\x91\x96\xab" + b"BlockStored" + b"\xdd\x0f\xff\xff\xff\x01",
}


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
@pytest.mark.parametrize("name", sorted(FORGED_COUNTS))
def test_a_forged_count_allocates_nothing_and_is_a_decode_error(engine: str, name: str) -> None:
    """The compiled reader sizes its arrays by a container's count: a count the payload's bytes
    cannot hold is refused before anything is allocated (it raised MemoryError, or allocated
    gigabytes, before), and the payload is a BridgeDecodeError like any malformed one."""
    payload = FORGED_COUNTS[name]
    conv = ZmqEventConverter(engine)
    assert conv.compiled
    conv.convert(msgspec.msgpack.encode([0.0, [["BlockStored", [1], None, [1], 1, None, "GPU"]]]))
    before = conv.to_state()
    tracemalloc.start()  # traces PyMem_Realloc, which the compiled reader grows its arrays by
    try:
        with pytest.raises(BridgeDecodeError):
            conv.convert(payload)
        assert not conv.convert_encoded(payload, EncodedEvents())  # not taken: convert decides
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, peak
    assert conv.to_state() == before


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
@pytest.mark.parametrize("hashes", [1, 3])
@pytest.mark.parametrize("block_size", [2**20 + 1, 2**62, 2**63 - 1])
def test_a_huge_block_size_is_left_to_the_python_paths(engine: str, hashes: int, block_size: int) -> None:
    """The compiled reader cut pages at ``i * block_size``: a huge block size overflowed its
    offsets and sized a block's tokens by it (MemoryError, found by ``make soak``). It now
    leaves block sizes past 2**20 to the Python paths, which read one partial page (one hash)
    or refuse the payload (three hashes cannot share ten tokens)."""
    payload = msgspec.msgpack.encode([1.5, [["BlockStored", list(range(1, hashes + 1)), None, list(range(10)), block_size, None, "GPU"]], 0])  # fmt: skip
    conv = ZmqEventConverter(engine)
    tracemalloc.start()
    try:
        assert not conv.convert_encoded(payload, EncodedEvents())
        if hashes == 1:
            (event,) = conv.convert(payload)
            assert [list(b.tokens) for b in event.data.blocks] == [list(range(10))]  # type: ignore[union-attr]
        else:
            with pytest.raises(BridgeDecodeError):
                conv.convert(payload)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, peak


NESTED = b"\x91" * 100_000 + b"\xc0"  # [[[...[nil]...]]], far deeper than any decoder's limit
DEEP_PAYLOADS = {
    "the batch": NESTED,
    "the events": b"\x92" + TS + NESTED,
    "an event's token ids (vLLM map)": b"\x92" + TS + b"\x91\x82\xa4type" + b"\xab" + b"BlockStored"
    + b"\xa9token_ids" + NESTED,
    "a map batch's events": b"\x82\xa2ts" + TS + b"\xa6events" + NESTED,
}  # fmt: skip


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
@pytest.mark.parametrize("where", sorted(DEEP_PAYLOADS))
def test_msgpack_nested_too_deep_is_a_decode_error_not_a_crash(engine: str, where: str) -> None:
    """msgspec raises RecursionError past its depth limit: one such payload stopped the live
    bridge's worker. It is a BridgeDecodeError (counted and set aside there) on every path, and
    the converter reads the next payload as before."""
    conv = ZmqEventConverter(engine)
    out = EncodedEvents()
    assert conv.convert_encoded(DEEP_PAYLOADS[where], out) is False and len(out) == 0
    with pytest.raises(BridgeDecodeError, match="nested too deeply"):
        conv.convert(DEEP_PAYLOADS[where])
    good = msgspec.msgpack.encode([1.5, [{"type": "BlockRemoved", "block_hashes": [1]}]])
    assert [type(e.data).__name__ for e in conv.convert(good)] == ["KVCacheRemovedData"]


BASE = {"event_id": 1, "window_size": 32, "attention_dp_rank": 0}
BLOCK = {"type": "stored_block", "block_hash": 1, "cache_level": 0, "priority": 35}
HOSTILE_TRTLLM = {
    "tokens nested deep": (
        {
            **BASE,
            "data": {
                "type": "stored",
                "parent_hash": None,
                "blocks": [{**BLOCK, "tokens": nested_list(50_000)}],
            },
        },
        "tokens[0] must be an int, got [[[",
    ),
    "cache levels nested deep": (
        {**BASE, "data": {"type": "created", "num_blocks_per_cache_level": nested_list(50_000)}},
        "num_blocks_per_cache_level[0] must be an int",
    ),
    "a type nested deep": ({**BASE, "data": {"type": nested_list(50_000)}}, "data.type [[["),
    "a hash of 5,000 digits": (
        {**BASE, "data": {"type": "removed", "block_hashes": [10**5000]}},
        "<an int of 16610 bits> does not fit in 64 bits",
    ),
    "a rank of 5,000 digits": (
        {**BASE, "attention_dp_rank": 10**5000, "data": {"type": "removed", "block_hashes": [1]}},
        "attention_dp_rank: <an int of 16610 bits> is out of range",
    ),
    "an event id of a million items": (
        {**BASE, "event_id": list(range(10**6)), "data": {"type": "removed", "block_hashes": [1]}},
        "event_id must be an int, got [0, 1, 2, 3, 4, 5, ...]",
    ),
}


@pytest.mark.parametrize("name", sorted(HOSTILE_TRTLLM))
def test_trtllm_values_nested_deep_or_huge_get_a_short_message(name: str) -> None:
    """An error message quotes the bad value cut short: repr() of a value nested 50,000 deep
    raised RecursionError and str() of an int of over 4,300 digits ValueError, instead of the
    TrtllmDecodeError that sets the event aside."""
    d, needle = HOSTILE_TRTLLM[name]
    with pytest.raises(TrtllmDecodeError) as caught:
        event_from_trtllm(d)
    assert needle in str(caught.value) and len(str(caught.value)) < 200


@pytest.mark.parametrize(
    ("content", "needle"),
    [
        (b"\xc1", "unreadable"),
        (NESTED, "unreadable"),  # RecursionError before
        (msgspec.msgpack.encode({"version": nested_list(20)}), "version [[[[...]]]], expected"),
        (
            msgspec.msgpack.encode({"version": STATE_VERSION, "engine": "sglang", "ranks": {}}),
            "'sglang' bridge",
        ),
    ],
)
def test_a_damaged_bridge_state_file_is_a_value_error_naming_it(
    tmp_path: Path, content: bytes, needle: str
) -> None:
    path = tmp_path / "bridge.state"
    path.write_bytes(content)
    with pytest.raises(ValueError, match=re.escape(needle)) as caught:
        load_state(path, "vllm")
    assert str(path) in str(caught.value)


def _vllm_batch(events: list) -> bytes:
    return msgspec.msgpack.encode([1.0, events])


def test_ever_new_media_stop_at_the_index_s_top_level_and_a_bounded_table() -> None:
    """Each unseen medium took the level after the highest known and was learned for good: a
    stream of new names cost a scan of all of them each (quadratic), and levels (the tier map's
    masks, 1 << level each) grew without bound."""
    from kvevents.producer.bridge.hashes import DEFAULT_MEDIUM_LEVELS, MAX_MEDIA, NEW_MEDIUM_LEVEL_MAX

    conv = ZmqEventConverter("vllm")
    conv.convert(_vllm_batch([["BlockStored", [7], None, [1, 2], 2, None, "GPU", None]]))
    levels = []
    for k in range(3 * MAX_MEDIA):
        events = conv.convert(_vllm_batch([["BlockStored", [7], None, [1, 2], 2, None, f"TIER{k}", None]]))
        levels += [e.data.cache_level.new_value for e in events if hasattr(e.data, "cache_level")]
        conv.convert(_vllm_batch([["BlockRemoved", [7], f"TIER{k}"]]))
    assert len(conv.media) == MAX_MEDIA
    assert max(conv.media.values()) == NEW_MEDIUM_LEVEL_MAX == 15
    past = 3 * MAX_MEDIA - (MAX_MEDIA - len(DEFAULT_MEDIUM_LEVELS))  # names never learned
    assert conv.stats()["new_medium.(past MAX_MEDIA)"] == 2 * past  # each stored and removed
    assert conv.tiers.level(0, 7) == 0 and levels == []  # GPU holds it throughout: no level change
    assert max(conv.tiers.held.values()).bit_length() <= NEW_MEDIUM_LEVEL_MAX + 1


def test_a_block_with_more_extra_keys_than_a_consumer_takes_is_refused_before_they_are_built() -> None:
    conv = ZmqEventConverter("vllm")
    keys = [[f"{k:064x}", 0] for k in range(300)]
    payload = _vllm_batch([["BlockStored", [7], None, [1, 2], 2, None, "GPU", None, [keys]]])
    with pytest.raises(BridgeDecodeError, match="extra_keys has 300 entries: more than the 256"):
        conv.convert(payload)
    assert len(conv.tiers) == 0
    ok = _vllm_batch([["BlockStored", [7], None, [1, 2], 2, None, "GPU", None, [keys[:256]]]])
    [event] = conv.convert(ok)
    assert len(event.data.blocks[0].mm_keys) == 256


def test_unknown_field_names_are_counted_under_bounded_names() -> None:
    from kvevents.producer.bridge.wire import COUNT_NAME_CHARS, COUNT_NAMES

    conv = ZmqEventConverter("vllm")
    for k in range(COUNT_NAMES + 50):
        name = f"field_{k}_" + "x" * 200
        conv.convert(msgspec.msgpack.encode({"ts": 1.0, "events": [], name: 1}))
    unknown = conv.wire_counts.unknown_fields
    assert len(unknown) == COUNT_NAMES + 1 and unknown["(other names)"] == 50
    assert max(len(name) for name in unknown) <= COUNT_NAME_CHARS
    assert sum(unknown.values()) == COUNT_NAMES + 50


def _saved_rank(**changes: object) -> dict[str, object]:
    converter = ZmqEventConverter("vllm").to_state()
    entry: dict[str, object] = {"last_seq": 5, "converter": converter}
    for name, value in changes.items():
        if name == "last_seq":
            entry["last_seq"] = value
        elif value is _GONE:
            del converter[name]
        else:
            converter[name] = value
    return entry


_GONE = object()


@pytest.mark.parametrize(
    ("changes", "needle"),
    [
        ({"tiers": _GONE}, "'tiers'"),
        ({"tiers": [[16, 7, -1]]}, "tier level -1 is negative"),
        ({"media": {"GPU": -3}}, "tier level -3 is negative"),
        ({"next_event_id": [1, 2]}, "has no attribute 'items'"),
        ({"window_size": "wide"}, "invalid literal"),
        ({"last_seq": "five"}, "last_seq 'five' is not a seq"),
        ({"last_seq": -2}, "last_seq -2 is not a seq"),
    ],
)
def test_a_damaged_rank_in_a_bridge_state_file_is_a_value_error_naming_it(
    tmp_path: Path, changes: dict[str, object], needle: str
) -> None:
    """A state file that decodes but holds a damaged rank entry: the bridge refuses it with the
    file and the rank named (the CLI prints it), not a KeyError or TypeError traceback."""
    path = tmp_path / "bridge.state"
    save_state(path, "vllm", {0: _saved_rank(), 1: _saved_rank(**changes)})
    with pytest.raises(ValueError, match=re.escape(needle)) as caught:
        ZmqBridge("vllm", "tcp://127.0.0.1:1", dp_size=2, state_path=path)
    assert str(path) in str(caught.value) and "rank 1" in str(caught.value)


def test_tier_levels_of_an_old_state_file_are_clamped_like_its_media() -> None:
    tiers = TierMap.from_state([[16, 7, 0, 40]])
    assert tiers.to_state() == [[16, 7, 0, 15]]
