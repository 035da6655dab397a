"""Content hashes: the documented kvh64 layout, its properties, and the compiled core agreeing."""

from __future__ import annotations

import pytest
from _index_helpers import batch, created, stored_blocks
from hypothesis import given, settings
from hypothesis import strategies as st
from kvevents.consumer import CacheIndex, WorkerKey
from kvevents.consumer.hashing import (
    ROOT_CONTENT_HASH,
    block_content_hash,
    content_hashes_for_tokens,
    salt_hash,
)
from kvevents.schemas import KVCacheStoredBlockData, encode_batch

MASK = 2**64 - 1


def doc_absorb(h: int, w: int) -> int:
    """kvh64's absorb, written from the module docstring (independently of the module)."""
    x = ((h ^ w) * 0x9E3779B97F4A7C15) % 2**64
    return x ^ (x >> 31)


def doc_finish(h: int) -> int:
    h ^= h >> 30
    h = (h * 0xBF58476D1CE4E5B9) % 2**64
    h ^= h >> 27
    h = (h * 0x94D049BB133111EB) % 2**64
    return h ^ (h >> 31)


def test_layout_matches_the_documentation():
    h = doc_absorb(ROOT_CONTENT_HASH, 3)  # header: 3 tokens, no flags, no mm keys
    h = doc_absorb(h, 1 | 2 << 32)
    h = doc_absorb(h, 3)
    assert block_content_hash(None, [1, 2, 3]) == doc_finish(h)
    parent = doc_finish(h)
    h = doc_absorb(parent, 2 | 1 << 32)  # 2 tokens, LoRA flag
    h = doc_absorb(h, 9)
    h = doc_absorb(h, (-1) & 0xFFFFFFFF | 0 << 32)  # token -1 as unsigned 32-bit
    assert block_content_hash(parent, [-1, 0], lora_id=9) == doc_finish(h)


def test_any_field_changes_the_hash():
    base = block_content_hash(None, [1, 2, 3, 4])
    variants = [
        block_content_hash(None, [1, 2, 3, 5]),
        block_content_hash(None, [1, 2, 3]),
        block_content_hash(1, [1, 2, 3, 4]),
        block_content_hash(None, [1, 2, 3, 4], lora_id=0),
        block_content_hash(None, [1, 2, 3, 4], token_extra_ids=[0, 0, 7, 0]),
        block_content_hash(None, [1, 2, 3, 4], mm_keys=((bytes(32), 0),)),
        block_content_hash(None, [1, 2, 3, 4], mm_keys=((bytes(32), 1),)),
        block_content_hash(None, [1, 2, 3, 4], cache_salt="x"),
    ]
    assert len({base, *variants}) == len(variants) + 1


def test_salt_only_counts_at_the_start_of_a_prefix_and_zero_extras_are_none():
    assert block_content_hash(5, [1, 2], cache_salt="x") == block_content_hash(5, [1, 2])
    assert block_content_hash(None, [1, 2], token_extra_ids=[0, 0]) == block_content_hash(None, [1, 2])
    assert salt_hash("é") == salt_hash("é".encode())


def test_chained_hashes_of_a_token_sequence():
    hashes = content_hashes_for_tokens(list(range(10)), 4, lora_id=2, cache_salt="s")
    first = block_content_hash(None, [0, 1, 2, 3], lora_id=2, cache_salt="s")
    assert hashes == [first, block_content_hash(first, [4, 5, 6, 7], lora_id=2)]
    with pytest.raises(ValueError, match="block_size"):
        content_hashes_for_tokens([1], 0)
    with pytest.raises(ValueError, match="token_extra_ids"):
        content_hashes_for_tokens([1, 2], 2, token_extra_ids=[1])


@settings(max_examples=200, deadline=None)
@given(
    tokens=st.lists(st.integers(-(2**31), 2**31 - 1), max_size=40),
    block_size=st.integers(1, 9),
    lora=st.none() | st.integers(0, MASK),
    salt=st.none() | st.text(max_size=12),
)
def test_compiled_query_hashes_equal_the_python_definition(tokens, block_size, lora, salt):
    compiled = CacheIndex(core="compiled")
    assert compiled.content_hashes(tokens, block_size, lora, cache_salt=salt) == content_hashes_for_tokens(
        tokens, block_size, lora, cache_salt=salt
    )


block_strategy = st.builds(
    lambda tokens, lora, extra, mm, salt, h: KVCacheStoredBlockData(
        h,
        tokens,
        lora_id=lora,
        token_extra_ids=extra[: len(tokens)] if extra is not None else None,
        mm_keys=tuple(mm),
        cache_salt=salt,
    ),
    tokens=st.lists(st.integers(-(2**31), 2**31 - 1), min_size=1, max_size=9),
    lora=st.none() | st.integers(0, MASK),
    extra=st.none() | st.lists(st.integers(0, MASK), min_size=9, max_size=9),
    mm=st.lists(st.tuples(st.binary(min_size=32, max_size=32), st.integers(-5, 40)), max_size=2),
    salt=st.none() | st.text(max_size=8),
    h=st.integers(0, MASK),
)


@settings(max_examples=150, deadline=None)
@given(blocks=st.lists(block_strategy, min_size=1, max_size=5, unique_by=lambda b: b.block_hash))
def test_stored_content_hashes_equal_the_python_definition_on_every_path(blocks):
    expected = []
    parent = None
    for b in blocks:
        parent = block_content_hash(parent, b.tokens, b.lora_id, b.token_extra_ids, b.mm_keys, b.cache_salt)
        expected.append((b.block_hash, parent))
    expected.sort()
    stream = batch([created(0), stored_blocks(1, blocks)], 0)
    for core in ("python", "compiled"):
        for entry in ("apply", "apply_encoded"):
            index = CacheIndex(core=core)
            if entry == "apply":
                index.apply(stream)
            else:
                index.apply_encoded(encode_batch(stream))
            got = [(e.block_hash, e.content_hash) for e in index.worker_blocks(WorkerKey("i0", 0), 64)]
            assert got == expected, (core, entry)


def test_a_wide_token_hashes_as_the_bridge_stores_it(core: str) -> None:
    """SGLang's multimodal pad values (up to 2**62 + 10**6) are stored as WIDE_TOKEN_ID with the
    value as the token's extra id; a query of the raw values finds them, on both cores."""
    from kvevents.schemas import WIDE_TOKEN_ID

    pad = 10**6 + 2**62 - 1
    index = CacheIndex(core=core)
    raw = [1, 2, pad, 3]
    stored = index.content_hashes([1, 2, WIDE_TOKEN_ID, 3], 2, token_extra_ids=[0, 0, pad, 0])
    assert index.content_hashes(raw, 2) == stored == content_hashes_for_tokens(raw, 2)
    assert index.content_hashes([1, 2, pad + 1, 3], 2)[1] != stored[1]
    assert index.content_hashes([1, 2, WIDE_TOKEN_ID, 3], 2)[1] != stored[1]
    with pytest.raises(ValueError, match="token 2 is wider than 32 bits and has an extra id"):
        content_hashes_for_tokens(raw, 2, token_extra_ids=[0, 0, 9, 0])


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"lora_id": 2**64}, r"lora_id 18446744073709551616 is outside 0\.\.2\*\*64-1"),
        ({"lora_id": -1}, r"lora_id -1 is outside"),
        ({"token_extra_ids": [0, -1, 0, 0]}, r"token_extra_ids\[1\] -1 is outside 0\.\.2\*\*64-1"),
        ({"token_extra_ids": [0, 0, 0, 2**64]}, r"token_extra_ids\[3\] 18446744073709551616 is outside"),
        (
            {"mm_keys": [[(bytes(32), 0)], [(bytes(32), 2**40)]]},
            r"mm_keys\[1\]\[0\] start offset 1099511627776",
        ),
    ],
)
def test_a_query_argument_no_stored_block_can_carry_is_refused_not_wrapped(
    core: str, arguments, message
) -> None:
    """Both cores hashed lora_id 2**64 as 0, -1 as 2**64-1 (an extra id too) and an offset of
    2**40 as 0: a query that matched blocks it does not describe."""
    index = CacheIndex(core=core)
    with pytest.raises(ValueError, match=message):
        index.content_hashes([1, 2, 3, 4], 2, **arguments)
    with pytest.raises(ValueError, match=message):
        index.find_matches_for_tokens([1, 2, 3, 4], 2, **arguments)
    with pytest.raises(ValueError, match=message):
        content_hashes_for_tokens([1, 2, 3, 4], 2, **arguments)
    assert index.content_hashes([1, 2, 3, 4], 2, lora_id=2**64 - 1, token_extra_ids=[2**64 - 1] * 4) == (
        content_hashes_for_tokens([1, 2, 3, 4], 2, 2**64 - 1, token_extra_ids=[2**64 - 1] * 4)
    )
