"""kvevents.consumer.dynamo: Dynamo's local block hashes (checked against Dynamo's own
``compute_block_hash_for_seq`` from ai-dynamo-runtime, the bench-dynamo extra CI installs) and
the RouterEvent JSON of each event kind."""

from __future__ import annotations

import json
import random
import struct
from array import array

import pytest
import xxhash
from dynamo.llm import compute_block_hash_for_seq
from hypothesis import given, settings
from hypothesis import strategies as st
from kvevents.consumer import WorkerKey
from kvevents.consumer import dynamo as dyn
from kvevents.consumer.dynamo import local_block_hashes, router_events
from kvevents.schemas import (
    EventBatch,
    KVCacheCreatedData,
    KVCacheEvent,
    KVCacheEventDiff,
    KVCacheRemovedData,
    KVCacheStoredBlockData,
    KVCacheStoredData,
    KVCacheUpdatedData,
)


def _by_formula(tokens: list[int], block_size: int, seed: int) -> list[int]:
    return [
        xxhash.xxh3_64_intdigest(struct.pack(f"<{block_size}I", *tokens[i : i + block_size]), seed=seed)
        for i in range(0, len(tokens) - block_size + 1, block_size)
    ]


@settings(max_examples=200, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 2**32 - 1), max_size=300),
    block_size=st.integers(1, 64),
    lora_name=st.sampled_from([None, "", "adapter-a", "sql-lora", "ünïcode"]),
)
def test_local_hashes_equal_dynamos_own(tokens: list[int], block_size: int, lora_name: str | None) -> None:
    ours = local_block_hashes(tokens, block_size, lora_name)
    assert ours == compute_block_hash_for_seq(tokens, block_size, lora_name=lora_name)
    assert len(ours) == len(tokens) // block_size  # full blocks only


def test_the_seed_rule_by_formula() -> None:
    rng = random.Random(3)
    tokens = [rng.randrange(2**31) for _ in range(100)]
    assert local_block_hashes(tokens, 16) == _by_formula(tokens, 16, 1337)
    lora = (1337 + xxhash.xxh3_64_intdigest(b"adapter-a")) % 2**64
    assert local_block_hashes(tokens, 16, "adapter-a") == _by_formula(tokens, 16, lora)
    assert local_block_hashes(tokens, 16, "") == local_block_hashes(tokens, 16)  # empty name = none
    namespaced = (lora + xxhash.xxh3_64_intdigest(b"ns", seed=1)) % 2**64
    assert local_block_hashes(tokens, 16, "adapter-a", cache_namespace="ns") == _by_formula(
        tokens, 16, namespaced
    )
    assert local_block_hashes(tokens, 16, "adapter-a", cache_namespace="ns") == compute_block_hash_for_seq(
        tokens, 16, lora_name="adapter-a", cache_namespace="ns"
    )
    # kvevents' own token arrays (array('i')) hash the same as lists
    assert local_block_hashes(array("i", tokens), 16) == local_block_hashes(tokens, 16)


def test_the_lora_seed_wraps_around_u64(monkeypatch: pytest.MonkeyPatch) -> None:
    """Dynamo adds with ``wrapping_add``: a name hash near 2**64 gives a small seed, never an
    out-of-range one (no real name is known to hit it, so the name hash is forced here)."""
    monkeypatch.setattr(dyn, "_xxh3", lambda data, seed=0: 2**64 - 5 if seed == 0 else 0)
    assert dyn.dynamo_seed("any") == 1337 - 5
    assert dyn.dynamo_seed(None) == 1337


def test_bad_input_is_named() -> None:
    with pytest.raises(ValueError, match="block_size must be >= 1"):
        local_block_hashes([1, 2], 0)
    with pytest.raises(ValueError, match="token id -1"):
        local_block_hashes([5, -1], 1)
    with pytest.raises(ValueError, match="token id -7"):
        local_block_hashes(array("i", [3, -7]), 1)
    with pytest.raises(ValueError, match=r"token id 4294967296"):
        local_block_hashes([2**32], 1)
    with pytest.raises(TypeError, match="lora_name must be a str or None, got int"):
        local_block_hashes([1, 2], 1, 5)  # type: ignore[arg-type]  # a LoRA id is not its name
    with pytest.raises(TypeError, match="cache_namespace must be a str or None, got bytes"):
        local_block_hashes([1, 2], 1, cache_namespace=b"ns")  # type: ignore[arg-type]


def _batch() -> EventBatch:
    big = 2**64 - 3
    return EventBatch(
        "engine-1",
        [
            KVCacheEvent(0, KVCacheCreatedData([64, 16]), 32, 1),
            KVCacheEvent(
                1,
                KVCacheStoredData(
                    None,
                    [
                        KVCacheStoredBlockData(big, [1, 2, 3, 4]),
                        KVCacheStoredBlockData(7, [5, 6, 7, 8], lora_id=3),
                        KVCacheStoredBlockData(8, [9, 9, 9, 9], lora_id=4),
                    ],
                ),
                32,
                1,
            ),
            KVCacheEvent(2, KVCacheUpdatedData(7, cache_level=KVCacheEventDiff(0, 1)), 32, 1),
            KVCacheEvent(3, KVCacheUpdatedData(7, priority=KVCacheEventDiff(35, 80)), 32, 1),
            KVCacheEvent(4, KVCacheRemovedData([8, big]), 32, 1),
            KVCacheEvent(0, KVCacheStoredData(11, [KVCacheStoredBlockData(12, [4, 3, 2, 1])]), 32),
            KVCacheEvent(5, KVCacheStoredData(None, [KVCacheStoredBlockData(13, [1, 1, 1, 1])]), 4096, 1),
        ],
        attention_dp_size=2,
    )


def test_router_events_map_each_kind() -> None:
    out = router_events(_batch(), lora_names={3: "adapter-a"})
    keys = [key for key, _ in out]
    assert keys == [WorkerKey("engine-1", 1)] * 3 + [WorkerKey("engine-1", 0), WorkerKey("engine-1", 1)]
    events = [event for _, event in out]
    assert events[0] == {"event_id": 0, "data": "cleared", "dp_rank": 1}
    assert events[1] == {
        "event_id": 1,
        "data": {
            "stored": {
                "parent_hash": None,
                "blocks": [
                    {"block_hash": 2**64 - 3, "tokens_hash": local_block_hashes([1, 2, 3, 4], 4)[0]},
                    {"block_hash": 7, "tokens_hash": local_block_hashes([5, 6, 7, 8], 4, "adapter-a")[0]},
                    {"block_hash": 8, "tokens_hash": local_block_hashes([9, 9, 9, 9], 4, "4")[0]},
                ],
            }
        },
        "dp_rank": 1,
    }
    # Updated (level and priority) has no Dynamo counterpart: ids 2 and 3 are absent
    assert events[2] == {"event_id": 4, "data": {"removed": {"block_hashes": [8, 2**64 - 3]}}, "dp_rank": 1}
    assert events[3]["dp_rank"] == 0 and events[3]["data"]["stored"]["parent_hash"] == 11  # rank None -> 0
    # JSON keeps the u64 hashes exact
    assert json.loads(json.dumps(events[1]))["data"]["stored"]["blocks"][0]["block_hash"] == 2**64 - 3


def test_router_events_window_filter() -> None:
    out = router_events(_batch(), window_size=4096)
    assert [e["event_id"] for _, e in out] == [5]


def test_multimodal_blocks_mix_their_object_hashes() -> None:
    mm = bytes(range(32))
    plain = KVCacheStoredBlockData(1, [1, 2, 3, 4])
    with_mm = KVCacheStoredBlockData(1, [1, 2, 3, 4], mm_keys=((mm, 0),))
    mm_u64 = int.from_bytes(mm[:8], "big")
    expected = xxhash.xxh3_64_intdigest(struct.pack("<4IQ", 1, 2, 3, 4, mm_u64), seed=1337)
    assert dyn.stored_block_dict(with_mm)["tokens_hash"] == expected
    assert dyn.stored_block_dict(with_mm)["tokens_hash"] != dyn.stored_block_dict(plain)["tokens_hash"]


def test_worker_ids_are_stable_and_below_2_63() -> None:
    assert dyn.worker_id_for("engine-1") == dyn.worker_id_for("engine-1") < 2**63
    assert dyn.worker_id_for("engine-1") != dyn.worker_id_for("engine-2")


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(-(2**31), 2**31 - 1), max_size=40))
def test_a_stored_block_is_routable_exactly_when_its_ids_fit_u32(tokens: list[int]) -> None:
    """The export reads a negative int32 from its bytes' sign bit, not by comparing every id."""
    raw = dyn._routable_bytes(array("i", tokens))
    if not tokens or min(tokens) < 0:
        assert raw is None
    else:
        assert raw == array("I", tokens).tobytes()
        assert dyn._routable_bytes(list(tokens)) == raw  # the plain-sequence path agrees
