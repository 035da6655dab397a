"""The typed fast path (``fastwire``) against the tolerant path: same events, same errors, same
state and counts, on engine-shaped payloads in every historical encoding and on odd variations."""

from __future__ import annotations

import time
from typing import Any

import msgspec
import pytest
from bridge_engines import encode, engine_structs
from bridge_payloads import KINDS, payload_sequences
from hypothesis import given, settings
from kvevents.producer.bridge import BridgeDecodeError, ZmqEventConverter
from kvevents.producer.bridge.fastwire import fast_parse


def run(engine: str, payloads: list[bytes], *, fast: bool) -> tuple[list[Any], ZmqEventConverter]:
    conv = ZmqEventConverter(engine, window_size=16, dp_rank=1, fast_path=fast, compiled=False)
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
    conv = ZmqEventConverter("sglang" if kind.startswith("sglang") else "vllm", compiled=False)
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
