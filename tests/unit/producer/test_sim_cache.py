"""The simulated paged block manager: hashes, reuse, eviction, offload, priorities, events."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from array import array

import pytest
from kvevents.producer.simulator.cache import (
    CacheFullError,
    PagedBlockCache,
    RetentionRange,
    block_hashes,
    chained_block_hash,
)
from kvevents.schemas import KVCacheEventDiff
from sim_support import RecordingEventManager, ReplayModel, truth_tuples

WINDOW = 4096


def tokens(seed: int, count: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(32_000) for _ in range(count)]


def make_cache(
    primary: int, secondary: int = 0, block_size: int = 4, **kwargs
) -> tuple[PagedBlockCache, RecordingEventManager]:
    events = RecordingEventManager()
    cache = PagedBlockCache(
        block_size=block_size,
        num_primary_blocks=primary,
        num_secondary_blocks=secondary,
        window_size=WINDOW,
        events=events,
        **kwargs,
    )
    cache.emit_created()
    return cache, events


def serve(cache: PagedBlockCache, rid: object, prompt: list[int], output: list[int], **kwargs) -> int:
    """One request through the cache as the engine drives it; returns its prefix hit in blocks."""
    hit = cache.add_sequence(rid, prompt, len(output), **kwargs)
    cache.store_blocks(rid, prompt)
    cache.store_blocks(rid, (prompt + output)[:-1])
    cache.release(rid)
    return hit


def check(cache: PagedBlockCache, events: RecordingEventManager) -> None:
    cache.check_invariants()
    model = ReplayModel()
    model.apply(events.calls)
    assert model.held(WINDOW) == truth_tuples(cache.held_blocks())


def removed(events: RecordingEventManager, since: int = 0) -> list[int]:
    return [c[1] for c in events.of_kind("removed", since)]


def level_moves(events: RecordingEventManager, since: int = 0) -> list[tuple[int, int, int]]:
    return [
        (c[1].block_hash, c[1].cache_level.old_value, c[1].cache_level.new_value)
        for c in events.of_kind("updated", since)
        if c[1].cache_level is not None
    ]


# ---------------------------------------------------------------------- hashes


def test_block_hash_is_chained_over_parent_tokens_and_lora() -> None:
    block = [5, 6, 7, 8]
    h = chained_block_hash(None, block)
    assert h == chained_block_hash(None, array("i", block))
    assert 0 <= h < 1 << 64
    assert chained_block_hash(h, block) != h
    assert chained_block_hash(None, block, lora_id=3) != h
    assert chained_block_hash(None, block, lora_id=0) != h
    assert chained_block_hash(None, block, lora_id=3) != chained_block_hash(None, block, lora_id=4)
    assert chained_block_hash(None, [5, 6, 8, 7]) != h


def test_block_hashes_cover_full_blocks_only_and_share_equal_prefixes() -> None:
    a = tokens(1, 4 * 3 + 3)
    b = a[:8] + tokens(2, 8)
    ha = block_hashes(a, 4)
    hb = block_hashes(b, 4)
    assert len(ha) == 3 and len(hb) == 4
    assert ha[:2] == hb[:2] and ha[2] != hb[2]
    parent = None
    for i, h in enumerate(ha):
        parent = chained_block_hash(parent, a[4 * i : 4 * i + 4])
        assert h == parent
    assert block_hashes(a, 4, max_blocks=1) == ha[:1]
    with pytest.raises(ValueError, match="block_size"):
        block_hashes(a, 0)
    with pytest.raises(ValueError, match="int32"):
        block_hashes([1 << 40], 1)


def test_block_hashes_are_the_same_in_another_process() -> None:
    toks = tokens(3, 64)
    code = (
        "import json, sys; from kvevents.producer.simulator.cache import block_hashes; "
        "print(json.dumps(block_hashes(json.loads(sys.argv[1]), 16, 7)))"
    )
    env = dict(os.environ, PYTHONHASHSEED="12345")
    out = subprocess.run(
        [sys.executable, "-c", code, json.dumps(toks)], capture_output=True, text=True, check=True, env=env
    )
    assert json.loads(out.stdout) == block_hashes(toks, 16, 7)


# ---------------------------------------------------------------------- reuse and storing


def test_same_prompt_twice_hits_every_full_block_and_stores_nothing_new() -> None:
    cache, events = make_cache(64)
    prompt, output = tokens(1, 4 * 5 + 2), tokens(2, 6)
    assert serve(cache, "a", prompt, output) == 0
    stored = events.of_kind("stored")
    assert len(stored) == 2  # after the context phase, then at the end with the output
    assert [b.block_hash for b in stored[0][1]] == block_hashes(prompt, 4)
    assert stored[0][1][0].prev_block_hash is None
    assert stored[1][1][0].prev_block_hash == stored[0][1][-1].block_hash
    assert [b.block_hash for b in stored[0][1] + stored[1][1]] == block_hashes((prompt + output)[:-1], 4)
    assert all(list(b.tokens) == prompt[4 * i : 4 * i + 4] for i, b in enumerate(stored[0][1]))
    mark = events.mark()
    assert serve(cache, "b", prompt, output) == 5
    assert events.of_kind("stored", mark) == []
    assert cache.stats.hit_blocks == 5 and cache.stats.matchable_blocks == 10
    check(cache, events)


def test_last_prompt_token_is_recomputed_so_an_aligned_prompt_reuses_one_block_less() -> None:
    cache, events = make_cache(64)
    prompt = tokens(3, 16)
    serve(cache, "a", prompt, [1])
    mark = events.mark()
    assert cache.match(prompt) == 4
    assert serve(cache, "b", prompt, [1]) == 3
    assert events.of_kind("stored", mark) == []  # the recomputed block is found cached: adopted, no event
    assert cache.stats.adopted_blocks == 1
    check(cache, events)


def test_a_block_stored_by_a_concurrent_request_is_adopted_not_duplicated() -> None:
    cache, events = make_cache(64)
    prompt = tokens(4, 13)
    cache.add_sequence("a", prompt, 3)
    cache.add_sequence("b", prompt, 3)  # both miss: nothing stored yet
    assert cache.store_blocks("a", prompt) == 3
    assert cache.store_blocks("b", prompt) == 0
    assert len(events.of_kind("stored")) == 1
    cache.check_invariants()
    assert cache.num_private == 2 * 4 - 3 - 3
    cache.release("a")
    cache.release("b")
    assert cache.num_cached() == 3 and cache.num_private == 0
    check(cache, events)


def test_match_counts_leading_held_blocks_without_side_effects() -> None:
    cache, events = make_cache(64)
    prompt = tokens(5, 20)
    serve(cache, "a", prompt, [9])
    n = len(events.calls)
    assert cache.match(prompt) == 5
    assert cache.match(prompt[:8] + tokens(6, 12)) == 2
    assert cache.match(prompt, lora_id=1) == 0
    assert cache.match(prompt[:3]) == 0
    assert len(events.calls) == n


def test_lora_requests_do_not_share_blocks_with_base_requests() -> None:
    cache, events = make_cache(64)
    prompt = tokens(7, 17)
    serve(cache, "a", prompt, [1], lora_id=5)
    assert all(b.lora_id == 5 for b in events.of_kind("stored")[0][1])
    assert serve(cache, "b", prompt, [1]) == 0
    assert serve(cache, "c", prompt, [1], lora_id=5) == 4
    check(cache, events)


# ---------------------------------------------------------------------- eviction


def one_block_request(cache: PagedBlockCache, rid: str, seed: int) -> list[int]:
    """Serve a request that caches exactly one block (block size 2, 3 prompt tokens, 1 output
    token); while it runs it holds two slots (its last block is partial)."""
    prompt = tokens(seed, 3)
    serve(cache, rid, prompt, [seed])
    return prompt


def first_hash(prompt: list[int]) -> int:
    return block_hashes(prompt, 2)[0]


def test_lru_evicts_the_least_recently_used_block_and_capacity_is_never_exceeded() -> None:
    cache, events = make_cache(7, block_size=2)
    h = {name: first_hash(one_block_request(cache, name, i)) for i, name in enumerate("ABCDEF")}
    assert cache.num_cached() == 6 and removed(events) == []
    one_block_request(cache, "G", 100)  # one slot free, two needed → A goes
    assert removed(events) == [h["A"]]
    assert serve(cache, "C again", tokens(2, 3), [7]) == 1  # C becomes the most recently used
    for name in "HIJ":
        one_block_request(cache, name, 100 + ord(name))
    assert removed(events) == [h["A"], h["B"], h["D"], h["E"]]
    assert h["C"] in cache.held_blocks()
    check(cache, events)


def test_leaves_go_before_their_parents() -> None:
    cache, events = make_cache(8, block_size=2)
    chain = tokens(10, 7)  # caches 3 blocks
    serve(cache, "chain", chain, [1])
    other = one_block_request(cache, "other", 11)
    for i in range(7):
        one_block_request(cache, f"filler{i}", 20 + i)
    # Oldest first: the chain's leaf, then its parent, then the root block — never a parent first.
    assert removed(events) == [*block_hashes(chain, 2)[::-1], first_hash(other)]
    check(cache, events)


def test_a_child_is_never_held_without_its_parent_even_when_the_parent_has_lower_priority() -> None:
    cache, events = make_cache(3, block_size=2)
    parent_child = tokens(12, 5)  # 2 full blocks; the child gets a high priority
    serve(cache, "pc", parent_child, [1], retention=[RetentionRange(2, None, 90)])
    held = cache.held_blocks()
    p_hash, c_hash = block_hashes(parent_child, 2)
    assert held[p_hash].priority == 35 and held[c_hash].priority == 90
    one_block_request(cache, "x", 30)
    one_block_request(cache, "y", 31)
    for h in removed(events):
        assert h != p_hash or c_hash not in cache.held_blocks()
    assert removed(events)[0] == c_hash  # the only leaf, despite its priority
    check(cache, events)


def test_lower_priority_blocks_are_evicted_first() -> None:
    cache, events = make_cache(4, block_size=2)
    vip = tokens(40, 3)
    serve(cache, "vip", vip, [1], retention=[RetentionRange(0, None, 80)])
    low = [one_block_request(cache, f"low{i}", 41 + i) for i in range(3)]
    one_block_request(cache, "new", 50)
    one_block_request(cache, "new2", 51)
    vip_hash = block_hashes(vip, 2)[0]
    assert vip_hash in cache.held_blocks()
    assert removed(events) == [block_hashes(p, 2)[0] for p in low[:2]] + [block_hashes(low[2], 2)[0]]
    check(cache, events)


def test_priority_change_on_reuse_is_an_updated_event() -> None:
    cache, events = make_cache(16)
    prompt = tokens(60, 13)
    serve(cache, "a", prompt, [1])
    first = block_hashes(prompt, 4)[0]
    mark = events.mark()
    serve(cache, "b", prompt, [1], retention=[RetentionRange(0, 4, 50)])
    updates = events.of_kind("updated", mark)
    assert len(updates) == 1
    data = updates[0][1]
    assert data.block_hash == first and data.priority == KVCacheEventDiff(35, 50) and data.cache_level is None
    assert cache.held_blocks()[first].priority == 50
    mark = events.mark()
    serve(cache, "c", prompt, [1])  # no retention asked: the priority stays
    serve(cache, "d", prompt, [1], retention=[RetentionRange(0, 4, 50)])  # same priority: no event
    assert events.of_kind("updated", mark) == []
    assert cache.stats.priority_updates == 1
    check(cache, events)


# ---------------------------------------------------------------------- offload and onboard


def test_evicted_primary_blocks_are_offloaded_and_onboarded_back_on_reuse() -> None:
    cache, events = make_cache(3, secondary=4, block_size=2)
    a, b = one_block_request(cache, "A", 1), one_block_request(cache, "B", 2)
    mark = events.mark()
    c = one_block_request(cache, "C", 3)  # one slot free, two needed → A is offloaded
    assert level_moves(events, mark) == [(first_hash(a), 0, 1)]
    assert removed(events) == []
    assert cache.held_blocks()[first_hash(a)].cache_level == 1
    cache.add_sequence("running", [5], 1)  # holds the last free primary slot
    mark = events.mark()
    assert cache.add_sequence("A again", a, 1) == 1  # reuses A from secondary memory
    # Primary is full: B is swapped out for A, then C makes room for the new block.
    assert level_moves(events, mark) == [(first_hash(b), 0, 1), (first_hash(a), 1, 0), (first_hash(c), 0, 1)]
    assert removed(events) == []
    cache.store_blocks("A again", a)
    cache.release("A again")
    cache.release("running")
    assert cache.stats.offloads == 3 and cache.stats.onboards == 1
    assert cache.num_cached(0) == 1 and cache.num_cached(1) == 2
    check(cache, events)


def test_a_full_secondary_level_evicts_its_lru_leaf_before_taking_an_offload() -> None:
    cache, events = make_cache(2, secondary=2, block_size=2)
    r = [first_hash(one_block_request(cache, f"r{i}", 70 + i)) for i in range(3)]
    # r0 and r1 went to secondary; r2 is in primary. One more request pushes r2 out.
    mark = events.mark()
    one_block_request(cache, "r3", 73)
    assert [c[0] for c in events.calls[mark:] if c[0] != "stored"] == ["removed", "updated"]
    assert removed(events, mark) == [r[0]]
    assert level_moves(events, mark) == [(r[2], 0, 1)]
    check(cache, events)


def test_blocks_below_the_offload_priority_are_dropped_not_offloaded() -> None:
    cache, events = make_cache(2, secondary=4, block_size=2, offload_min_priority=30)
    low = tokens(80, 3)
    serve(cache, "low", low, [1], retention=[RetentionRange(0, None, 10)])
    one_block_request(cache, "next", 81)
    assert removed(events) == block_hashes(low, 2)
    assert level_moves(events) == []
    check(cache, events)


def test_dropping_a_primary_block_removes_its_offloaded_descendants_first() -> None:
    cache, events = make_cache(3, secondary=1, block_size=2)
    chain = tokens(90, 5)  # blocks p, c
    serve(cache, "chain", chain, [1], retention=[RetentionRange(0, 2, 10)])  # p below offload priority
    p, c = block_hashes(chain, 2)
    one_block_request(cache, "x", 91)
    one_block_request(cache, "y", 92)  # c offloaded (the leaf), then p (priority 10) dropped with c
    assert level_moves(events) == [(c, 0, 1)]
    assert removed(events) == [c, p]
    check(cache, events)


# ---------------------------------------------------------------------- admission and errors


def test_admission_fails_cleanly_when_every_block_is_referenced() -> None:
    cache, events = make_cache(4, block_size=2)
    cache.add_sequence("big", tokens(100, 6), 2)  # takes all 4 blocks
    assert not cache.can_admit(tokens(101, 1), 1)
    with pytest.raises(CacheFullError, match="needs 1 primary blocks"):
        cache.add_sequence("more", tokens(101, 1), 1)
    assert cache.num_running == 1
    cache.release("big")
    assert cache.can_admit(tokens(101, 1), 1)
    check(cache, events)


def test_bad_calls_raise_clear_errors() -> None:
    cache, _ = make_cache(8)
    with pytest.raises(ValueError, match="num_primary_blocks"):
        PagedBlockCache(block_size=4, num_primary_blocks=0)
    with pytest.raises(ValueError, match="block_size"):
        PagedBlockCache(block_size=0, num_primary_blocks=4)
    cache.add_sequence("a", [1, 2, 3], 1)
    with pytest.raises(ValueError, match="already running"):
        cache.add_sequence("a", [1, 2, 3], 1)
    with pytest.raises(ValueError, match="at least one prompt token"):
        cache.add_sequence("b", [], 1)
    with pytest.raises(ValueError, match="max_new_tokens"):
        cache.add_sequence("b", [1], 0)
    with pytest.raises(KeyError, match="not running"):
        cache.store_blocks("zzz", [1, 2, 3, 4])
    with pytest.raises(ValueError, match="reserved only"):
        cache.store_blocks("a", tokens(1, 40))
    with pytest.raises(KeyError, match="not running"):
        cache.release("zzz")


def test_created_event_carries_both_levels() -> None:
    _, events = make_cache(10, secondary=3)
    assert events.calls[0] == ("created", [10, 3], WINDOW)


def test_a_parent_whose_children_were_offloaded_is_next_in_lru_order() -> None:
    cache, events = make_cache(4, secondary=8, block_size=2)
    chain = tokens(95, 5)  # blocks p, c (released leaf first: c is older than p)
    serve(cache, "chain", chain, [1])
    p, c = block_hashes(chain, 2)
    one_block_request(cache, "o", 96)  # newer than the chain
    one_block_request(cache, "x", 97)  # c goes (the oldest leaf); p becomes a leaf
    one_block_request(cache, "y", 98)  # p is now older than o: p goes
    assert level_moves(events) == [(c, 0, 1), (p, 0, 1)]
    check(cache, events)


def test_retention_priorities_match_the_per_block_rule() -> None:
    """The slice-built priorities of a run of blocks equal ``retention_priority`` block by block."""
    import random

    from kvevents.producer.simulator.blocks import RetentionRange, retention_priorities, retention_priority

    rng = random.Random(5)
    for _ in range(2000):
        bs = rng.choice((1, 3, 8, 16, 32))
        ranges = []
        for _ in range(rng.randrange(4)):
            start = rng.randrange(-10, 200)
            end = None if rng.random() < 0.3 else start + rng.randrange(-5, 200)
            ranges.append(RetentionRange(start, end, rng.randrange(101)))
        start = rng.randrange(0, 12)
        stop = start + rng.randrange(-2, 20)
        want = [retention_priority(ranges, i, bs) for i in range(start, stop)]
        assert retention_priorities(ranges, bs, start, stop) == want, (ranges, bs, start, stop)
