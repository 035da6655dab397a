"""The typed fast path (``fastwire``) against the tolerant path: same events, same errors, same
state and counts, on engine-shaped payloads in every historical encoding and on odd variations."""

from __future__ import annotations

import time
from typing import Any

import msgspec
import pytest
from bridge_engines import encode, engine_structs
from hypothesis import given, settings
from hypothesis import strategies as st
from kvevents.producer.bridge import BridgeDecodeError, ZmqEventConverter
from kvevents.producer.bridge.fastwire import fast_parse

KINDS = ["vllm", "vllm-positional", "sglang-old", "sglang", "sglang-map"]

hashes = st.lists(
    st.one_of(st.integers(-(2**63), 2**64 - 1), st.integers(0, 40), st.binary(min_size=1, max_size=33)),
    max_size=4,
)
odd = st.one_of(st.none(), st.booleans(), st.integers(-3, 3), st.text(max_size=4), st.floats(allow_nan=False))
media = st.one_of(st.sampled_from(["GPU", "CPU", "cpu", "DISK", "NVME"]), st.none(), odd)
mm_key = st.one_of(st.binary(min_size=32, max_size=32), st.text(max_size=4), st.integers(0, 9))
extra_keys = st.one_of(
    st.none(),
    st.lists(
        st.one_of(st.none(), mm_key, st.lists(st.one_of(mm_key, st.tuples(mm_key, st.integers(-2, 9))))),
        max_size=4,
    ),
    odd,
)


@st.composite
def engine_event(draw: Any, kind: str) -> Any:
    """An event of ``kind``'s structs, with fields that are mostly right and sometimes odd."""
    s = engine_structs(kind)
    choice = draw(st.sampled_from(["stored", "stored", "stored", "removed", "removed", "cleared"]))
    if choice == "cleared":
        return s["AllBlocksCleared"]()
    hs = draw(hashes)
    if not kind.startswith("vllm"):
        hs = [h for h in hs if isinstance(h, int) and -(2**63) <= h < 2**63]
    if choice == "removed":
        args: list[Any] = [hs]
        if kind != "sglang-old":
            args.append(draw(media) if kind.startswith("vllm") else draw(st.none() | st.text(max_size=4)))
        return s["BlockRemoved"](*args)
    size = draw(st.one_of(st.integers(1, 4), st.integers(-1, 0)))
    n_tokens = draw(st.one_of(st.just(len(hs) * max(size, 1)), st.integers(0, 12)))
    token = st.one_of(st.integers(0, 32000), st.integers(-(2**40), 2**40))
    tokens = draw(st.lists(token, min_size=n_tokens, max_size=n_tokens))
    parent = draw(st.one_of(st.none(), st.integers(-(2**63), 2**63 - 1)))
    lora_id = draw(st.one_of(st.none(), st.integers(-(2**63), 2**63 - 1)))
    args = [hs, parent, tokens, size, lora_id]
    if kind.startswith("vllm") and draw(st.booleans()):  # plain, as most batches are
        args[4] = None
        args += [draw(st.sampled_from(["GPU", "CPU", None])), None, None, None, None, None]
    elif kind.startswith("vllm"):
        args += [draw(media), draw(st.none() | st.text(max_size=4))]
        args += [draw(extra_keys), draw(st.none() | st.integers(0, 3)), draw(st.none() | st.text(max_size=4))]
        args += [draw(st.none() | st.integers(-1, 64))]
    elif kind == "sglang":
        meta = st.dictionaries(st.sampled_from(["cache_salt", "lora_name", "x"]), st.text(max_size=4))
        args += [draw(st.none() | st.text(max_size=4)), draw(st.none() | meta)]
    elif kind == "sglang-map":
        args += [draw(st.none() | st.text(max_size=4))] * 3
    return s["BlockStored"](*args)


@st.composite
def payload_sequences(draw: Any) -> tuple[str, list[bytes]]:
    kind = draw(st.sampled_from(KINDS))
    s = engine_structs(kind)
    payloads = []
    for _ in range(draw(st.integers(1, 4))):
        events = draw(st.lists(engine_event(kind), max_size=5))
        rank = draw(st.none() | st.integers(0, 3)) if kind not in ("sglang-old",) else None
        batch = s["Batch"](1.5, events) if rank is None else s["Batch"](1.5, events, rank)
        payload = encode(batch)
        if draw(st.integers(0, 9)) == 0:  # an odd top level now and then
            obj = msgspec.msgpack.decode(payload)
            if isinstance(obj, dict):
                obj[draw(st.sampled_from(["attn_dp_rank", "dp_rank", "x"]))] = draw(odd)
            else:
                obj.append(draw(odd))
            payload = msgspec.msgpack.encode(obj)
        payloads.append(payload)
    return ("sglang" if kind.startswith("sglang") else "vllm", payloads)


def run(engine: str, payloads: list[bytes], *, fast: bool) -> tuple[list[Any], ZmqEventConverter]:
    conv = ZmqEventConverter(engine, window_size=16, dp_rank=1, fast_path=fast)
    outcomes: list[Any] = []
    for payload in payloads:
        try:
            outcomes.append(conv.convert(payload))
        except BridgeDecodeError as exc:
            outcomes.append(("error", str(exc)))
    return outcomes, conv


@settings(max_examples=300, deadline=None)
@given(payload_sequences())
def test_fast_path_equals_tolerant_path(case: tuple[str, list[bytes]]) -> None:
    engine, payloads = case
    fast_out, fast = run(engine, payloads, fast=True)
    slow_out, slow = run(engine, payloads, fast=False)
    assert fast_out == slow_out
    assert fast.to_state() == slow.to_state()
    assert fast.stats() == slow.stats()
    assert fast.last_batch_ts == slow.last_batch_ts
    assert slow.fast_payloads == 0


@pytest.mark.parametrize("kind", KINDS)
def test_fast_path_reads_every_engine_encoding(kind: str) -> None:
    s = engine_structs(kind)
    tail: list[Any] = ["GPU", None] if kind.startswith("vllm") else []
    stored = s["BlockStored"]([7, -8], None, list(range(8)), 4, None, *tail)
    removed = s["BlockRemoved"]([7], *tail[:1])
    batch = s["Batch"](time.time(), [stored, removed, s["AllBlocksCleared"]()])
    parsed = fast_parse(encode(batch))
    assert parsed is not None
    assert [type(e).__name__ for e in parsed.events] == ["RawStored", "RawRemoved", "RawCleared"]
    assert parsed.events[0].block_hashes == [7, 2**64 - 8]  # type: ignore[union-attr]
    conv = ZmqEventConverter("sglang" if kind.startswith("sglang") else "vllm")
    conv.convert(encode(batch))
    assert conv.fast_payloads == 1


@pytest.mark.parametrize(
    "obj",
    [
        [1.0, [["BlockStored", [b"\x01" * 32], None, [], 1]]],  # a digest hash
        [1.0, [["BlockStored", [1], None, [1], 1, None, "GPU", {"cache_salt": "s"}]]],  # metadata map
        [1.0, [["BlockStored", [1], None, [2**40], 1]]],  # not an int32 token
        [1.0, [["Mystery", 1]]],  # an unknown tag
        {"ts": 1.0, "events": [{"type": "BlockRemoved", "block_hashes": [1], "x": 1}]},  # unknown field
        [1.0, [], -1],  # a negative rank
        [True, []],  # a bool ts
        [1.0, [["BlockStored", [1], None, [1, 2], None]]],  # tokens and no block_size
    ],
)
def test_fast_path_leaves_odd_shapes_to_the_tolerant_path(obj: Any) -> None:
    assert fast_parse(msgspec.msgpack.encode(obj)) is None
