"""The compiled converter (``_fastconvert``) against the pure-Python paths: the same events, errors,
state and counts on every payload shape, which shapes it takes itself, and that anything it does
not take (or cannot read) is left untouched for the Python paths."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
from bridge_engines import encode, engine_structs
from bridge_payloads import KINDS, payload_sequences
from hypothesis import given, settings
from hypothesis import strategies as st
from kvevents.producer.bridge import BridgeDecodeError, TierMap, ZmqEventConverter
from kvevents.producer.bridge import _fastconvert as fastconvert  # built by make setup
from kvevents.producer.bridge import convert as convert_module
from kvevents.producer.sink_encoded import EncodedEvents

V = engine_structs("vllm")
enc = msgspec.msgpack.encode
DIGEST = bytes(range(32))


def outcomes(conv: ZmqEventConverter, payloads: list[bytes]) -> list[Any]:
    out: list[Any] = []
    for payload in payloads:
        try:
            out.append(conv.convert(payload))
        except BridgeDecodeError as exc:
            out.append(("error", str(exc)))
    return out


def both(engine: str, payloads: list[bytes], **kw: Any) -> tuple[ZmqEventConverter, ZmqEventConverter]:
    """The compiled converter and the tolerant (oracle) one after ``payloads``, checked equal."""
    compiled = ZmqEventConverter(engine, **kw)
    oracle = ZmqEventConverter(engine, fast_path=False, compiled=False, **kw)
    assert compiled.compiled, "the compiled converter is not in use"
    assert outcomes(compiled, payloads) == outcomes(oracle, payloads)
    assert compiled.to_state() == oracle.to_state()
    assert compiled.stats() == oracle.stats()
    assert compiled.last_batch_ts == oracle.last_batch_ts
    assert oracle.compiled_payloads == oracle.fast_payloads == 0
    return compiled, oracle


def test_module_is_the_one_in_use_and_builds_blocks_by_copy() -> None:
    assert convert_module.compiled_convert is fastconvert.convert
    assert fastconvert.copied_blocks()


@settings(max_examples=300, deadline=None)
@given(payload_sequences())
def test_compiled_equals_tolerant_path(case: tuple[str, list[bytes]]) -> None:
    engine, payloads = case
    both(engine, payloads, window_size=16, dp_rank=1)


def _plain(kind: str) -> list[Any]:
    s = engine_structs(kind)
    tail: list[Any] = ["GPU", None] if kind.startswith("vllm") else []
    if kind in ("sglang", "sglang-map"):
        tail = ["GPU"]
    return [
        s["BlockStored"]([7, -8, 9], None, list(range(10)), 4, None, *tail),  # partial last page
        s["BlockStored"]([10], 9, [1, 2, 3, 4], 4, None, *tail),
        s["BlockRemoved"]([7], *tail[:1]),
        s["AllBlocksCleared"](),
        s["BlockStored"]([2**63 + 5], None, [-(2**31), 2**31 - 1], 2, None, *tail),
    ]


@pytest.mark.parametrize(
    ("kind", "rank"),
    [(k, r) for k in KINDS for r in (None, 0, 3) if r is None or k != "sglang-old"],  # 0.4: no rank
)
def test_takes_every_engine_encoding(kind: str, rank: int | None) -> None:
    s = engine_structs(kind)
    batch = s["Batch"](1.25, _plain(kind)) if rank is None else s["Batch"](1.25, _plain(kind), rank)
    engine = "sglang" if kind.startswith("sglang") else "vllm"
    compiled, _ = both(engine, [encode(batch)] * 2, dp_rank=1)
    assert compiled.compiled_payloads == 2
    assert compiled.counts["partial_blocks"] == 2
    assert compiled.next_event_id == {1 if rank is None else rank: 10}


def test_takes_digests_folded_per_engine() -> None:
    payload = encode(
        V["Batch"](1.0, [V["BlockStored"]([DIGEST, b"\x01\x02"], DIGEST, [1, 2], 1, None, None, None)])
    )
    for engine in ("vllm", "sglang"):
        compiled, _ = both(engine, [payload])
        assert compiled.compiled_payloads == 1
    vllm = ZmqEventConverter("vllm").convert(payload)[0].data
    sglang = ZmqEventConverter("sglang").convert(payload)[0].data
    assert vllm.parent_hash == int.from_bytes(DIGEST[-8:], "big")
    assert sglang.parent_hash == int.from_bytes(DIGEST[:8], "big")
    assert [b.block_hash for b in vllm.blocks] == [int.from_bytes(DIGEST[-8:], "big"), 0x0102]


def test_takes_tier_moves_through_the_tier_map() -> None:
    def batch(*events: Any) -> bytes:
        return encode(V["Batch"](2.0, list(events)))

    stored = V["BlockStored"]
    removed = V["BlockRemoved"]
    payloads = [
        batch(stored([1, 2, 3], None, list(range(6)), 2, None, "GPU", None)),
        batch(stored([2, 3, 4], 1, list(range(6)), 2, None, "CPU", None)),  # 2, 3 on both; 4 CPU only
        batch(removed([2], "GPU"), removed([4], "CPU"), removed([99], "GPU")),  # 2 -> CPU level
        batch(stored([2], None, [5, 6], 2, None, "GPU", None), removed([3], "DISK")),  # back; not on DISK
        batch(stored([1], None, [1, 2], 2, None, "GPU", None)),  # already held
    ]
    compiled, _ = both("vllm", payloads)
    assert compiled.compiled_payloads == len(payloads)
    assert compiled.counts["removed_unknown"] == 1
    assert compiled.counts["removed_not_on_medium"] == 1
    assert compiled.counts["blocks_already_held"] == 3  # 2 and 3 on CPU too, then 1 again
    assert compiled.tiers.level(0, 2) == 0 and compiled.tiers.level(0, 3) == 0
    assert compiled.tiers.to_state() == [[0, 1, 0], [0, 2, 0, 1], [0, 3, 0, 1]]


def test_takes_vllm_offloading_placeholders_in_both_paths() -> None:
    """vLLM's OffloadingConnector stores a CPU copy as one hash, no tokens, ``block_size`` 0, in
    the same batch as GPU events: taken here, as the tolerant path reads it (counts included)."""
    stored = V["BlockStored"]
    payloads = [
        encode(V["Batch"](1.0, [
            stored([1, 2], None, [1, 2, 3, 4], 2, None, "GPU", None),
            stored([2], None, [], 0, None, "CPU", None),  # a copy of a block the GPU holds
            stored([7], None, [], 0, None, "CPU", None),  # on CPU only
            stored([8, 9], None, [], None, None, "CPU", None),  # no block_size at all
            stored([10, 11], None, [], 2, None, "CPU", None),  # a block_size, no tokens
            V["BlockRemoved"]([2], "GPU"),
        ])),
    ]  # fmt: skip
    compiled, oracle = both("vllm", payloads)
    assert compiled.compiled_payloads == 1
    assert compiled.counts["blocks_without_tokens"] == 6
    out = EncodedEvents()
    fresh = ZmqEventConverter("vllm")
    assert fresh.convert_encoded(payloads[0], out)
    assert out.decode() == ZmqEventConverter("vllm", fast_path=False, compiled=False).convert(payloads[0])
    assert fresh.stats() == oracle.stats()


def test_takes_sglang_bigram_token_pairs_in_both_paths() -> None:
    """SGLang with EAGLE publishes every Stored event's token ids as (token, next token) pairs."""
    sg = engine_structs("sglang-0.5.23")
    raw = list(range(40, 49))
    pairs = [[raw[j], raw[j + 1]] for j in range(8)]
    payload = encode(sg["Batch"](1.0, [
        sg["BlockStored"]([21, 22], None, pairs, 4, None, "GPU"),
        sg["BlockStored"]([23], 22, [[1, 2**63 + 1], [2, 3]], 2, None, "GPU"),  # a wide next token
        sg["BlockRemoved"]([21], "GPU"),
    ], 0))  # fmt: skip
    compiled, oracle = both("sglang", [payload])
    assert compiled.compiled_payloads == 1 and compiled.counts["token_pair_blocks"] == 3
    out = EncodedEvents()
    fresh = ZmqEventConverter("sglang")
    assert fresh.convert_encoded(payload, out)
    assert out.decode() == ZmqEventConverter("sglang", fast_path=False, compiled=False).convert(payload)
    assert fresh.stats() == oracle.stats()


def test_takes_sglang_salt_and_session_keys() -> None:
    s = engine_structs("sglang-map")
    event = s["BlockStored"]([1, 2], None, [1, 2, 3, 4], 2, None, "GPU", "salt", "session-9")
    compiled, _ = both("sglang", [encode(s["Batch"](1.0, [event], 0))])
    assert compiled.compiled_payloads == 1


def test_takes_kv_cache_groups_and_learns_their_windows() -> None:
    """Current vLLM names each block's group and spec (array and map forms): the compiled
    converter takes them, with the windows the groups teach, as the Python paths give them."""
    stored = V["BlockStored"]
    events = [
        stored([1, 2], None, [1, 2, 3, 4], 2, None, "GPU", None, None, 0, "full_attention"),
        stored([3], None, [5, 6], 2, None, "GPU", None, None, 1, "sliding_window", 128),
        V["BlockRemoved"]([1], "GPU", 0),
        V["BlockRemoved"]([3], "GPU", 1),
        V["BlockRemoved"]([9], "GPU", 7),  # a group never described (not 0): skipped, counted
        stored([4], None, [7, 8], 2, None, "GPU", None, None, 1),  # a known group, no spec again
    ]
    for kind in ("vllm", "vllm-positional"):
        s = engine_structs(kind)
        compiled, _ = both(
            "vllm", [encode(s["Batch"](1.0, events[:2])), encode(s["Batch"](1.0, events[2:]))], window_size=16
        )
        assert compiled.compiled_payloads == 2
        assert compiled.group_windows == {0: 16, 1: 128} and compiled.counts["unknown_group"] == 1
        assert compiled.counts["skipped_group_events"] == 1


def test_takes_a_vllm_0_26_payload_as_captured() -> None:
    """vLLM 0.26's events as a user captured them (an array batch of map events, one None extra
    key per block, the group and its spec named): the compiled converter takes them, and the
    typed fast path too, with the tolerant path's events."""
    event = {
        "type": "BlockStored",
        "block_hashes": [15760518052499183552],
        "parent_block_hash": None,
        "token_ids": [
            151644,
            872,
            198,
            9064,
            374,
            279,
            6722,
            315,
            5616,
            30,
            151645,
            198,
            151644,
            77091,
            198,
            151667,
        ],
        "block_size": 16,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
        "extra_keys": [None],
        "group_idx": 0,
        "kv_cache_spec_kind": "full_attention",
    }
    payload = enc([1789095808.8378847, [event], 0])
    compiled, _ = both("vllm", [payload])
    assert compiled.compiled_payloads == 1
    typed = ZmqEventConverter("vllm", compiled=False)
    typed.convert(payload)
    assert typed.fast_payloads == 1
    assert ZmqEventConverter("vllm").convert_encoded(payload, EncodedEvents())
    mismatched = enc([1.0, [{**event, "extra_keys": [None, None]}], 0])  # counted by the Python paths
    compiled, _ = both("vllm", [mismatched])
    assert compiled.compiled_payloads == 0 and compiled.stats()["extra_keys_length_mismatch"] == 1


def test_kv_cache_groups_in_the_pre_encoded_path() -> None:
    """The Avro bytes of the pre-encoded path carry each event's window too."""
    stored = V["BlockStored"]
    payload = encode(V["Batch"](1.0, [
        stored([1], None, [1, 2], 2, None, "GPU", None, None, 0, "full_attention"),
        stored([3], None, [5, 6], 2, None, "GPU", None, None, 1, "sliding_window", 128),
        V["BlockRemoved"]([3], "GPU", 1),
    ]))  # fmt: skip
    conv, oracle = (
        ZmqEventConverter("vllm", window_size=16),
        ZmqEventConverter("vllm", window_size=16, compiled=False, fast_path=False),
    )
    out = EncodedEvents()
    assert conv.convert_encoded(payload, out)
    events = oracle.convert(payload)
    assert [e.window_size for e in events] == [16, 128, 128]
    assert out.decode() == events
    assert conv.to_state() == oracle.to_state()


@pytest.mark.parametrize(
    "event",
    [
        V["BlockStored"]([1], None, [1], 1, 5, None, None),  # LoRA id
        V["BlockStored"]([1], None, [1], 1, None, None, "adapter"),  # LoRA name
        V["BlockStored"]([1], None, [1], 1, None, None, None, [[DIGEST]]),  # extra keys
        V["BlockStored"]([1], None, [1], 1, None, None, None, None, 2**64 - 1),  # a group past 64 bits
        V["BlockStored"]([1], None, [1], 1, None, "NVME", None),  # a new medium
    ],
)
def test_leaves_other_shapes_to_the_python_paths(event: Any) -> None:
    compiled, _ = both("vllm", [encode(V["Batch"](1.0, [event]))])
    assert compiled.compiled_payloads == 0


@pytest.mark.parametrize(
    "obj",
    [
        [1.0, [["Mystery", 1]]],  # an unknown tag
        {"ts": 1.0, "events": [], "x": 1},  # an unknown batch field
        {"ts": 1.0, "events": [{"type": "BlockRemoved", "block_hashes": [1], "x": 1}]},  # unknown field
        [1.0, [["BlockStored", [1], None, [1], 1, None, "GPU", {"cache_salt": "s"}]]],  # metadata
        [1.0, [], -1],  # a negative rank
        [True, []],  # a bool ts
        [1.0, [["BlockStored", [True], None, [1], 1]]],  # a bool hash
        [1.0, [["BlockStored", [1], None, [1, 2], None]]],  # tokens and no block_size
        [1.0, [["BlockStored", [1], None, [2**40], 1]]],  # not an int32 token
        [1.0, [["BlockStored", [1, 2], None, [1, 2, 3, 4, 5], 2]]],  # too many tokens
        [1.0, [["BlockStored", [b""], None, [1], 1]]],  # an empty digest
        [1.0, [["BlockStored", [1], None, [1], 0]]],  # block_size 0
        [1.0, [["AllBlocksCleared", 1]]],  # a field too many
        [1.0],  # no events
        b"\x82" + enc("ts") + enc(1.0) + enc("ts") + enc(2.0),  # a repeated key
        b"\x92"
        + enc(1.0)
        + b"\x91\x83"
        + enc("type")
        + enc("BlockRemoved")
        + (enc("block_hashes") + enc([1])) * 2,  # a repeated key in an event
        enc([1.0, []]) + b"\x00",  # trailing bytes
        b"\x92\xc1\x90",  # a reserved byte
    ],
)
def test_odd_or_bad_payloads_are_left_untouched(obj: Any) -> None:
    payload = obj if isinstance(obj, bytes) else msgspec.msgpack.encode(obj)
    conv = ZmqEventConverter("vllm")
    before = conv.to_state()
    assert fastconvert.convert(conv, payload) is None
    assert conv.to_state() == before and not conv.counts
    both("vllm", [payload])


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_damaged_bytes_give_the_same_outcome(data: Any) -> None:
    """Truncated or flipped bytes of valid payloads: the compiled reader never crashes, and what
    it does not read the tolerant path reads or names, as without it."""
    kind = data.draw(st.sampled_from(KINDS))
    s = engine_structs(kind)
    payload = bytearray(encode(s["Batch"](1.0, _plain(kind))))
    for _ in range(data.draw(st.integers(1, 3))):
        at = data.draw(st.integers(0, len(payload) - 1))
        payload[at] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(1, len(payload)))
    both("sglang" if kind.startswith("sglang") else "vllm", [bytes(payload[:cut])])


def test_not_bytes_is_left_to_the_python_paths() -> None:
    conv = ZmqEventConverter("vllm")
    assert fastconvert.convert(conv, bytearray(encode(V["Batch"](1.0, [])))) is None


def test_tier_map_masks_round_trip_through_the_state_rows() -> None:
    tiers = TierMap()
    assert tiers.store(0, 5, 2).kind == "stored"
    assert tiers.store(0, 5, 0).kind == "updated"
    assert tiers.store(0, 5, 1).kind == "none"
    assert tiers.store(16, 5, 3).kind == "stored"
    rows = tiers.to_state()
    assert rows == [[0, 5, 0, 1, 2], [16, 5, 3]]
    again = TierMap.from_state(rows)
    assert again.held == tiers.held
    assert again.remove(0, 5, 0) == tiers.remove(0, 5, 0)
    assert again.level(0, 5) == 1
    assert again.remove(0, 5, 1).kind == "updated" and again.remove(0, 5, 2).kind == "removed"
    assert not again.knows(0, 5) and again.level(0, 5) is None
