"""CacheIndex's content rules (docs/INDEX.md "Rules", content hashes), on both cores, fed model
objects and real Avro bytes: orphans, blocks without tokens, what separates one content from
another, and matching by tokens across engines whose hashes differ."""

from __future__ import annotations

import pytest
from _index_helpers import (
    BLOCK,
    W0,
    W1,
    WINDOW,
    batch,
    block,
    created,
    removed,
    stored,
    stored_blocks,
    tokens_for,
    tokens_of,
)
from kvevents.consumer import WorkerKey


def test_block_with_unknown_parent_is_an_orphan_found_by_engine_hash_only(index, feed):
    feed(index, batch([created(0), stored(1, [5, 6], parent=4)], 0))
    assert index.find_matches([5, 6]) == {W0: 2}
    assert index.find_matches_for_tokens(tokens_for([4, 5, 6]), BLOCK) == {}
    assert [b.content_hash for b in index.worker_blocks(W0, WINDOW)] == [None, None]
    assert index.stats().counters["orphan_blocks"] == 2


def test_orphan_gains_content_when_another_worker_stores_its_prefix(index, feed):
    feed(
        index,
        batch(
            [
                created(0, rank=0),
                created(0, rank=1),
                stored(1, [5], parent=4, rank=0),
                stored(1, [4, 5], rank=1),
            ],
            0,
            dp=2,
        ),
    )
    assert index.find_matches_for_tokens(tokens_for([4, 5]), BLOCK) == {W1: 2}
    assert index.find_matches_by_content(index.content_hashes(tokens_for([4, 5]), BLOCK)[1:]) == {
        W0: 1,
        W1: 1,
    }


def test_blocks_without_tokens_have_no_content_nor_do_blocks_after_them(index, feed):
    """vLLM's offloading connector stores placeholders: a hash, no tokens, no parent. Hashed,
    every one of them would have the same content (a root with nothing in it), one ever
    longer run of equal keys in the content table."""
    placeholders = [stored_blocks(1 + i, [block(700 + i, tokens=[])]) for i in range(3)]
    chain = stored_blocks(4, [block(5), block(6, tokens=[]), block(7)])
    feed(index, batch([created(0), *placeholders, chain], 0))
    assert index.find_matches([700]) == {W0: 1} and index.find_matches([5, 6, 7]) == {W0: 3}
    contents = {b.block_hash: b.content_hash for b in index.worker_blocks(W0, WINDOW)}
    assert contents[5] is not None
    assert [contents[h] for h in (700, 701, 702, 6, 7)] == [None] * 5
    assert index.find_matches_for_tokens(tokens_of(5), BLOCK) == {W0: 1}
    assert index.stats().counters["orphan_blocks"] == 5


def test_a_block_without_tokens_gains_content_when_stored_with_them(index, feed):
    feed(
        index,
        batch(
            [
                created(0, rank=0),
                created(0, rank=1),
                stored_blocks(1, [block(9, tokens=[])], rank=0),
                stored(1, [9], rank=1),
            ],
            0,
            dp=2,
        ),
    )
    assert index.find_matches_for_tokens(tokens_of(9), BLOCK) == {W0: 1, W1: 1}


def test_tokens_match_across_workers_whose_engine_hashes_differ(index, feed):
    # vLLM-style: each engine seeds its hashes, so the same tokens have other hashes
    a = [block(100 + i, tokens=tokens_of(i)) for i in (1, 2, 3)]
    b = [block(200 + i, tokens=tokens_of(i)) for i in (1, 2)]
    feed(index, batch([created(0), stored_blocks(1, a)], 0, instance="a"))
    feed(index, batch([created(0), stored_blocks(1, b)], 0, instance="b"))
    query = [*tokens_for([1, 2, 3]), 0, 1]  # a trailing partial block is ignored
    assert index.find_matches_for_tokens(query, BLOCK) == {WorkerKey("a", 0): 3, WorkerKey("b", 0): 2}
    assert index.find_matches([101, 102, 103]) == {WorkerKey("a", 0): 3}  # engine hashes: "a" only
    feed(index, batch([removed(2, [202])], 1, instance="b"))
    assert index.find_matches_for_tokens(query, BLOCK) == {WorkerKey("a", 0): 3, WorkerKey("b", 0): 1}


def test_content_depends_on_the_prefix(index, feed):
    feed(
        index,
        batch(
            [
                created(0),
                stored_blocks(1, [block(1), block(2)]),
                stored_blocks(2, [block(3, tokens=tokens_of(2))]),
            ],
            0,
        ),
    )
    # block 3 has block 2's tokens but no parent: it matches a query starting with those tokens
    assert index.find_matches_for_tokens(tokens_of(2), BLOCK) == {W0: 1}
    assert index.find_matches_for_tokens(tokens_for([1, 2]), BLOCK) == {W0: 2}


@pytest.mark.parametrize(
    ("stored_kw", "query_kw"),
    [
        ({"lora_id": 3}, {"lora_id": 3}),
        ({"cache_salt": "tenant-a"}, {"cache_salt": "tenant-a"}),
    ],
)
def test_lora_and_salt_separate_content(index, feed, stored_kw, query_kw):
    blocks = [block(1, **stored_kw), block(2, **stored_kw)]
    feed(index, batch([created(0), stored_blocks(1, blocks)], 0))
    query = tokens_for([1, 2])
    assert index.find_matches_for_tokens(query, BLOCK) == {}
    assert index.find_matches_for_tokens(query, BLOCK, **query_kw) == {W0: 2}
    other = {k: (4 if k == "lora_id" else "tenant-b") for k in query_kw}
    assert index.find_matches_for_tokens(query, BLOCK, **other) == {}


def test_salt_counts_on_the_first_block_only(index, feed):
    blocks = [block(1, cache_salt="s"), block(2, cache_salt="other, ignored")]
    feed(index, batch([created(0), stored_blocks(1, blocks)], 0))
    assert index.find_matches_for_tokens(tokens_for([1, 2]), BLOCK, cache_salt="s") == {W0: 2}


def test_extra_ids_and_multimodal_keys_separate_content(index, feed):
    mm = ((bytes(range(32)), 1),)
    blocks = [block(1, token_extra_ids=[0, 9, 0, 0], mm_keys=mm)]
    feed(index, batch([created(0), stored_blocks(1, blocks)], 0))
    plain = tokens_of(1)
    assert index.find_matches_for_tokens(plain, BLOCK) == {}
    assert index.find_matches_for_tokens(plain, BLOCK, token_extra_ids=[0, 9, 0, 0]) == {}
    assert index.find_matches_for_tokens(plain, BLOCK, token_extra_ids=[0, 9, 0, 0], mm_keys=[mm]) == {W0: 1}
    assert (
        index.find_matches_for_tokens(plain, BLOCK, token_extra_ids=[0, 9, 0, 0], mm_keys=[((bytes(32), 1),)])
        == {}
    )


def test_all_zero_extra_ids_are_the_same_as_none(index, feed):
    feed(index, batch([created(0), stored_blocks(1, [block(1, token_extra_ids=[0, 0, 0, 0])])], 0))
    assert index.find_matches_for_tokens(tokens_of(1), BLOCK) == {W0: 1}


def test_rank_none_is_rank_zero(index, feed):
    feed(index, batch([created(0, rank=None), stored(1, [1], rank=None)], 0))
    assert index.find_matches([1]) == {W0: 1}


def test_conflicting_content_for_one_engine_hash_keeps_the_first_and_counts(index, feed):
    feed(index, batch([created(0), stored_blocks(1, [block(1, tokens=[1, 2, 3, 4])])], 0, instance="a"))
    feed(index, batch([created(0), stored_blocks(1, [block(1, tokens=[5, 6, 7, 8])])], 0, instance="b"))
    assert index.stats().counters["content_conflicts"] == 1
    assert index.find_matches_for_tokens([1, 2, 3, 4], BLOCK) == {WorkerKey("a", 0): 1, WorkerKey("b", 0): 1}
