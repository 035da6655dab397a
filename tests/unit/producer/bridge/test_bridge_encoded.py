"""The pre-encoded path against the object path, for the same payloads: the compiled converter's
Avro bytes (``ZmqEventConverter.convert_encoded``) are byte for byte the codec's encoding of the
events ``convert`` builds, with the same ids, ranks, state and counts; what it does not take
(damaged, unknown or rare shapes) leaves everything untouched for the Python paths; and the
sink's chunker cuts pre-encoded events into the same message bytes as the objects (splits of a
Stored event at the size limit and oversized events included)."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
from bridge_engines import encode, engine_structs
from bridge_payloads import KINDS, payload_sequences
from hypothesis import given, settings
from hypothesis import strategies as st
from kvevents.producer.bridge import BridgeDecodeError, ZmqEventConverter
from kvevents.producer.bridge import convert as convert_module
from kvevents.producer.sink_chunks import Chunk, Chunker, EnvelopeWriter, LostEvent, SingleObjectCodec
from kvevents.producer.sink_encoded import EncodedChunker, EncodedEvents, encode_event
from kvevents.schemas import (
    EventBatch,
    KVCacheEvent,
    KVCacheRemovedData,
    KVCacheStoredBlockData,
    KVCacheStoredData,
    encode_body,
)

V = engine_structs("vllm")


def outcome(conv: ZmqEventConverter, payload: bytes) -> Any:
    try:
        return conv.convert(payload)
    except BridgeDecodeError as exc:
        return ("error", str(exc))


def assert_same_bytes(out: EncodedEvents, events: list[KVCacheEvent]) -> None:
    """``out`` holds exactly the codec's encoding of ``events``, one by one."""
    expected = b"".join(encode_event(e) for e in events)
    assert bytes(out.data) == expected
    assert list(out.ids) == [e.event_id for e in events]
    assert list(out.ranks) == [e.attention_dp_rank for e in events]
    ends, at = [], 0
    for e in events:
        at += len(encode_event(e))
        ends.append(at)
    assert list(out.ends) == ends
    assert out.decode() == events
    # and as one batch: the same body as the codec writes for these events
    body = encode_body(EventBatch("", events, 1))
    assert out.message(encode_body(EventBatch("", [], 1))[:-1]) == body


def run_both(engine: str, payloads: list[bytes], **kw: Any) -> tuple[ZmqEventConverter, int]:
    """The encoding converter and the object one after ``payloads``, checked equal; returns the
    encoding converter and how many payloads it took."""
    enc = ZmqEventConverter(engine, **kw)
    obj = ZmqEventConverter(engine, **kw)
    assert enc.compiled and convert_module.compiled_encode is not None
    taken = 0
    for payload in payloads:
        out = EncodedEvents()
        before = enc.to_state(), dict(enc.counts)
        if enc.convert_encoded(payload, out):
            taken += 1
            expected = obj.convert(payload)
            assert_same_bytes(out, expected)
        else:  # untouched: the Python paths read it (or name its error) as for the objects
            assert len(out) == 0 and (enc.to_state(), dict(enc.counts)) == before
            assert outcome(enc, payload) == outcome(obj, payload)
        assert enc.to_state() == obj.to_state()
        assert enc.stats() == obj.stats()
        assert enc.last_batch_ts == obj.last_batch_ts
    return enc, taken


@settings(max_examples=250, deadline=None)
@given(payload_sequences())
def test_encoded_equals_objects(case: tuple[str, list[bytes]]) -> None:
    engine, payloads = case
    run_both(engine, payloads, window_size=16, dp_rank=1)


@pytest.mark.parametrize("kind", KINDS)
def test_takes_the_common_shapes_of_every_engine(kind: str) -> None:
    s = engine_structs(kind)
    tail: list[Any] = ["GPU", None] if kind.startswith("vllm") else []
    if kind in ("sglang", "sglang-map"):
        tail = ["GPU"]
    events = [
        s["BlockStored"]([7, -8, 9], None, list(range(10)), 4, None, *tail),  # partial last page
        s["BlockStored"]([10], 9, [1, 2, 3, 4], 4, None, *tail),
        s["BlockRemoved"]([7], *tail[:1]),
        s["AllBlocksCleared"](),
        s["BlockStored"]([2**63 + 5], None, [-(2**31), 2**31 - 1], 2, None, *tail),
    ]
    engine = "sglang" if kind.startswith("sglang") else "vllm"
    payload = encode(s["Batch"](1.25, events))
    conv, taken = run_both(engine, [payload, payload], window_size=32, dp_rank=2)
    assert taken == 2 and conv.compiled_payloads == 2


def test_tier_moves_and_salts() -> None:
    """GPU/CPU stores and removes become Updated events with the levels; salts are carried."""
    M = engine_structs("vllm")
    Stored = msgspec.defstruct(
        "BlockStored",
        [("block_hashes", list[int]), ("parent_block_hash", int | None), ("token_ids", list[int]),
         ("block_size", int), ("lora_id", int | None), ("medium", str | None), ("cache_salt", str | None)],
        tag=True, omit_defaults=True,
    )  # fmt: skip
    batches = [
        [Stored([1, 2, 3], None, list(range(6)), 2, None, "GPU", "tenant-é")],
        [Stored([2, 3, 4], 1, list(range(6)), 2, None, "CPU", None)],  # 2, 3 held: no event; 4 new
        [M["BlockRemoved"]([2], "GPU")],  # 2 stays on CPU: Updated 0 -> 1
        [Stored([2], 1, [5, 6], 2, None, "GPU", None)],  # back on GPU: Updated 1 -> 0
        [M["BlockRemoved"]([3, 4, 99], "CPU"), M["BlockRemoved"]([3, 1], "GPU")],
        [M["AllBlocksCleared"](), M["BlockRemoved"]([2], None)],
    ]
    payloads = [encode(M["Batch"](float(i), events)) for i, events in enumerate(batches)]
    conv, taken = run_both("vllm", payloads)
    assert taken == len(payloads)
    assert conv.counts["blocks_already_held"] == 2 and conv.counts["removed_unknown"] >= 1


def test_damaged_and_unknown_payloads_fall_back_untouched() -> None:
    good = encode(V["Batch"](1.0, [V["BlockStored"]([1, 2], None, [1, 2, 3, 4], 2, None, "GPU", None)]))
    lora = encode(V["Batch"](1.0, [V["BlockStored"]([5], None, [1, 2], 2, 7, "GPU", None)]))
    unknown_tag = msgspec.msgpack.encode({"ts": 1.0, "events": [{"type": "BlockMoved", "block_hashes": [1]}]})
    new_medium = encode(V["Batch"](1.0, [V["BlockStored"]([6], None, [1, 2], 2, None, "NVME", None)]))
    payloads = [good, good[:-3], b"\xc1", b"", lora, unknown_tag, new_medium, good + b"\x00", good]
    conv, taken = run_both("vllm", payloads, window_size=8)
    assert taken == 2  # only the two plain batches; the others went through the Python paths
    assert conv.counts["payloads"] == 5  # good x2, lora, unknown tag (skipped), new medium


def test_a_view_is_not_appended_to() -> None:
    payload = encode(V["Batch"](1.0, [V["BlockRemoved"]([1], "GPU")]))
    conv = ZmqEventConverter("vllm")
    whole = EncodedEvents.of([KVCacheEvent(0, KVCacheRemovedData([5]), 0, 0)] * 2)
    with pytest.raises(TypeError, match="whole EncodedEvents"):
        conv.convert_encoded(payload, whole[1:])
    assert conv.to_state()["next_event_id"] == {} and len(whole) == 2


def test_values_the_schema_cannot_carry_are_left_to_the_python_paths() -> None:
    payload = encode(V["Batch"](1.0, [V["BlockRemoved"]([1], "GPU")]))
    conv = ZmqEventConverter("vllm", window_size=2**31)  # over Avro's int
    out = EncodedEvents()
    assert not conv.convert_encoded(payload, out) and len(out) == 0
    assert conv.to_state()["next_event_id"] == {}


# -- the sink's chunker ------------------------------------------------------------------------


def _block(h: int, tokens: int) -> KVCacheStoredBlockData:
    return KVCacheStoredBlockData(h, list(range(h % 7, h % 7 + tokens)), cache_level=h % 2)


events_st = st.lists(
    st.one_of(
        st.builds(
            lambda blocks, tokens, parent: KVCacheStoredData(
                parent, [_block(1000 + b, tokens) for b in range(blocks)]
            ),
            st.integers(1, 60),
            st.integers(1, 40),
            st.none() | st.integers(0, 2**64 - 1),
        ),
        st.builds(KVCacheRemovedData, st.lists(st.integers(0, 2**64 - 1), min_size=1, max_size=80)),
    ),
    min_size=1,
    max_size=40,
)


def _signature(item: Chunk | LostEvent) -> Any:
    if isinstance(item, LostEvent):
        return item
    split = None if item.split is None else (item.split.rank, item.split.event_id, item.split.fragments)
    return (
        bytes(item.part),
        item.events,
        item.by_rank,
        item.last_event_ids,
        item.first_event_block_offset,
        split,
    )


@settings(max_examples=150, deadline=None)
@given(
    events_st,
    st.sampled_from([64, 300, 1500, 20_000, 1 << 20]),
    st.sampled_from([1, 3, 2000]),
    st.booleans(),
    st.integers(1, 3),
)
def test_chunker_cuts_encoded_events_into_the_same_bytes(
    datas: list[Any], budget: int, max_events: int, multi_rank: bool, drains: int
) -> None:
    events = [
        KVCacheEvent(i, data, 16, (i % 3 if multi_rank else 0)) for i, data in enumerate(datas)
    ]  # fmt: skip
    single = not multi_rank
    plain = Chunker(EnvelopeWriter(SingleObjectCodec(), "engine", 4), single, max_events)
    spliced = EncodedChunker(EnvelopeWriter(SingleObjectCodec(), "engine", 4), single, max_events)
    step = -(-len(events) // drains)
    for start in range(0, len(events), step):  # several drains: the size estimate carries over
        part = events[start : start + step]
        a = [_signature(c) for c in plain.chunks(part, budget)]
        b = [_signature(c) for c in spliced.chunks(EncodedEvents.of(part), budget)]
        assert a == b
    assert spliced.splices_encoded is True


def test_chunker_splits_a_stored_event_at_the_limit_as_objects_do() -> None:
    big = KVCacheEvent(5, KVCacheStoredData(77, [_block(b, 16) for b in range(400)]), 16, 1)
    small = KVCacheEvent(6, KVCacheRemovedData([1, 2, 3]), 16, 1)
    too_big = KVCacheEvent(7, KVCacheRemovedData(list(range(2**60, 2**60 + 400))), 16, 1)
    events = [small, big, too_big, small]
    plain = Chunker(EnvelopeWriter(SingleObjectCodec(), "engine", 2), False, 2000)
    spliced = EncodedChunker(EnvelopeWriter(SingleObjectCodec(), "engine", 2), False, 2000)
    a = [_signature(c) for c in plain.chunks(events, 1024)]
    b = [_signature(c) for c in spliced.chunks(EncodedEvents.of(events), 1024)]
    assert a == b
    offsets = [s[4] for s in b if not isinstance(s, LostEvent) and s[5] is not None]
    assert len(offsets) > 3 and offsets[0] == 0 and offsets == sorted(offsets)  # split into fragments
    assert any(isinstance(s, LostEvent) and s.reason == "oversized" for s in b)


def test_views_and_appends() -> None:
    events = [KVCacheEvent(i, KVCacheRemovedData([i]), 0, None if i % 2 else 3) for i in range(6)]
    enc = EncodedEvents.of(events[:3])
    enc.extend(EncodedEvents.of(events)[3:])
    assert enc.decode() == events
    view = enc[2:5]
    assert len(view) == 3 and view.decode() == events[2:5] and view[-1] == events[4]
    assert view.count_by_rank() == {3: 2, 0: 1} and view.event_id(0) == 2
    with pytest.raises(ValueError, match="view"):
        view.add(events)
    assert EncodedEvents()[0:0].message(b"p") == b"p\x00"


def test_without_the_compiled_converter_the_bridge_hands_objects(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvevents.producer.bridge.live import ZmqBridge

    monkeypatch.setattr(convert_module, "compiled_encode", None)
    payload = encode(V["Batch"](1.0, [V["BlockRemoved"]([1], "GPU")]))
    conv = ZmqEventConverter("vllm")
    assert not conv.convert_encoded(payload, EncodedEvents()) and conv.to_state()["next_event_id"] == {}
    bridge = ZmqBridge("vllm", "tcp://127.0.0.1:9", checkpoint_interval=3600)
    try:
        assert bridge.preencoded is False
    finally:
        bridge.close()
