"""BlockInfo: what an engine hands to enqueue_stored_event; checked and converted once."""

from __future__ import annotations

from array import array

import msgspec
import pytest
from kvevents.producer import BlockInfo
from kvevents.schemas import DEFAULT_PRIORITY

U64_MAX = (1 << 64) - 1


def test_defaults_match_the_design_signature() -> None:
    block = BlockInfo(7, None, [1, 2, 3])
    assert block.block_hash == 7
    assert block.prev_block_hash is None
    assert block.tokens == array("i", [1, 2, 3])
    assert block.lora_id is None
    assert block.is_primary is True
    assert block.priority == DEFAULT_PRIORITY == 35
    assert block.token_extra_ids is None
    assert block.mm_keys == ()
    assert block.cache_salt is None


def test_is_immutable() -> None:
    block = BlockInfo(7, 6, [1])
    with pytest.raises(AttributeError):
        block.block_hash = 8  # type: ignore[misc]


def test_tokens_become_int32_array_and_an_int32_array_is_kept_as_is() -> None:
    assert BlockInfo(1, None, range(4)).tokens == array("i", [0, 1, 2, 3])
    tokens = array("i", [5, 6])
    assert BlockInfo(1, None, tokens).tokens is tokens
    assert BlockInfo(1, None, array("l", [5, 6])).tokens.typecode == "i"


def test_full_u64_range_of_hashes_and_lora_ids_is_accepted() -> None:
    block = BlockInfo(U64_MAX, 0, [1], lora_id=U64_MAX)
    assert (block.block_hash, block.prev_block_hash, block.lora_id) == (U64_MAX, 0, U64_MAX)


def test_integer_like_hashes_are_normalised_to_int() -> None:
    class Index:
        def __index__(self) -> int:
            return 42

    block = BlockInfo(Index(), Index(), [1])  # type: ignore[arg-type]
    assert block.block_hash.__class__ is int and block.block_hash == 42
    assert block.prev_block_hash == 42


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"block_hash": -1}, "block_hash"),
        ({"block_hash": 1 << 64}, "block_hash"),
        ({"block_hash": "1"}, "block_hash"),
        ({"block_hash": True}, "block_hash"),
        ({"prev_block_hash": -5}, "prev_block_hash"),
        ({"tokens": [1 << 31]}, "tokens"),
        ({"tokens": ["a"]}, "tokens"),
        ({"lora_id": -1}, "lora_id"),
        ({"is_primary": 1}, "is_primary"),
        ({"priority": 101}, "priority"),
        ({"priority": -1}, "priority"),
        ({"token_extra_ids": [1]}, "token_extra_ids"),
        ({"token_extra_ids": [-1, 0]}, "token_extra_ids"),
        ({"mm_keys": [(b"short", 0)]}, "mm_keys"),
        ({"mm_keys": [(b"x" * 32, -1)]}, "mm_keys"),
        ({"mm_keys": [b"x" * 32]}, "mm_keys"),
        ({"cache_salt": 5}, "cache_salt"),
    ],
)
def test_bad_values_raise_value_error_naming_the_field(kwargs: dict[str, object], field: str) -> None:
    args: dict[str, object] = {"block_hash": 1, "prev_block_hash": None, "tokens": [1, 2]}
    args.update(kwargs)
    with pytest.raises(ValueError, match=rf"BlockInfo\.{field}"):
        BlockInfo(**args)  # type: ignore[arg-type]


def test_extra_ids_all_zero_mean_none_and_others_become_uint64_array() -> None:
    assert BlockInfo(1, None, [1, 2], token_extra_ids=[0, 0]).token_extra_ids is None
    extra = BlockInfo(1, None, [1, 2], token_extra_ids=[0, U64_MAX]).token_extra_ids
    assert extra == array("Q", [0, U64_MAX])


def test_mm_keys_become_a_tuple_of_bytes_offset_pairs() -> None:
    digest = bytearray(b"h" * 32)
    block = BlockInfo(1, None, [1], mm_keys=[(digest, 3)])
    assert block.mm_keys == ((b"h" * 32, 3),)
    assert block.mm_keys[0][0].__class__ is bytes
    assert BlockInfo(1, None, [1], mm_keys=[]).mm_keys == ()


def test_equal_by_value() -> None:
    assert BlockInfo(1, 2, [3], cache_salt="s") == BlockInfo(1, 2, array("i", [3]), cache_salt="s")
    assert BlockInfo(1, 2, [3]) != BlockInfo(1, 2, [4])
    assert msgspec.structs.asdict(BlockInfo(1, None, [3]))["tokens"] == array("i", [3])
