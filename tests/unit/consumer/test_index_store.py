"""The compiled core's block store (``_nodestore.pxd``) against the pure core: the content table
holds several nodes per content hash (one per engine hash that stands for it), holder runs
grow and shrink across their size classes, and node ids widen past 2**16 (the table entries
are rewritten with fewer fingerprint bits) while blocks come and go through the apply path."""

from __future__ import annotations

import random

import pytest
from _index_helpers import batch, block, created, removed, stored_blocks, updated
from kvevents.consumer.index import CacheIndex, compiled_core_available
from kvevents.schemas import KVCacheEvent


def _compiled() -> CacheIndex:
    """A compiled-core index; a core that is not built is a failure, not a skip."""
    if not compiled_core_available():
        pytest.fail("kvevents.consumer._indexcore is not built")
    return CacheIndex(core="compiled")


def _pair() -> list[CacheIndex]:
    return [CacheIndex(core="python"), _compiled()]


class _Feed:
    """Sends the same events to both cores, one batch per event, per (instance, rank)."""

    def __init__(self, indexes: list[CacheIndex], workers: int) -> None:
        self.indexes = indexes
        self.eid = dict.fromkeys(range(workers), 1)
        self.seq = 1
        self.send_all([created(0, rank=w) for w in range(workers)], seq=0)

    def send_all(self, events: list[KVCacheEvent], seq: int) -> None:
        for index in self.indexes:
            index.apply(batch(events, seq, "i0", dp=len(self.eid)))

    def send(self, worker: int, make: object) -> None:
        event = make(self.eid[worker], worker)  # type: ignore[operator]
        self.eid[worker] += 1
        self.send_all([event], self.seq)
        self.seq += 1


def _same(indexes: list[CacheIndex], queries: list[list[int]], content: list[list[int]]) -> None:
    python, compiled = indexes
    assert compiled.same_state(python)
    for q in queries:
        assert compiled.find_matches(q) == python.find_matches(q), q[:3]
    for q in content:
        assert compiled.find_matches_by_content(q) == python.find_matches_by_content(q), q[:3]


@pytest.mark.parametrize("seed", range(3))
def test_one_content_under_many_engine_hashes(seed: int) -> None:
    """vLLM-like: every worker hashes the same prompt with its own seed, so one content hash
    stands for many engine hashes; removals in random order keep the others found."""
    rng = random.Random(seed)
    indexes = _pair()
    workers = 12
    feed = _Feed(indexes, workers)
    tokens = [[100 * b + i for i in range(4)] for b in range(6)]
    own = {w: [(w + 1) * 1_000_003 + b for b in range(6)] for w in range(workers)}
    for w in range(workers):
        blocks = [block(h, tokens=t) for h, t in zip(own[w], tokens, strict=True)]
        feed.send(w, lambda eid, r, blocks=blocks: stored_blocks(eid, blocks, rank=r))
    content = indexes[0].content_hashes([t for ts in tokens for t in ts], 4)
    assert len(indexes[1].find_matches_by_content(content)) == workers
    order = [(w, b) for w in range(workers) for b in range(6)]
    rng.shuffle(order)
    for k, (w, b) in enumerate(order):
        feed.send(w, lambda eid, r, h=own[w][b]: removed(eid, [h], rank=r))
        if k % 5 == 0:
            _same(indexes, [own[w], own[(w + 1) % workers]], [content, content[:3]])
    _same(indexes, [own[0]], [content])
    assert indexes[1].find_matches_by_content(content) == {}


@pytest.mark.parametrize("seed", range(3))
def test_holder_runs_grow_and_shrink(seed: int) -> None:
    """One prefix held by 1..40 workers and back (every run size class both ways), with the
    matching's same-holders shortcut checked at each step."""
    rng = random.Random(seed)
    indexes = _pair()
    workers = 40
    feed = _Feed(indexes, workers)
    prefix = list(range(5000, 5020))
    order = list(range(workers))
    rng.shuffle(order)
    for k, w in enumerate(order):
        feed.send(w, lambda eid, r: stored_blocks(eid, [block(h) for h in prefix], rank=r))
        tail = [9_000_000 + 100 * w + i for i in range(3)]
        feed.send(
            w,
            lambda eid, r, tail=tail: stored_blocks(eid, [block(h) for h in tail], parent=prefix[-1], rank=r),
        )
        if k % 3 == 0:
            _same(indexes, [prefix, prefix + tail, prefix[:7]], [])
    rng.shuffle(order)
    for k, w in enumerate(order):
        cut = rng.randrange(len(prefix))
        feed.send(w, lambda eid, r, cut=cut: removed(eid, prefix[cut:], rank=r))
        if k % 3 == 0:
            _same(indexes, [prefix, prefix[: cut + 1], prefix[:3]], [])
    _same(indexes, [prefix], [])


def test_node_ids_widen_while_blocks_come_and_go() -> None:
    """Past 2**16 nodes the tables are rebuilt for wider ids; stores and removals keep the
    compiled core equal to the pure one (state bytes and matches)."""
    indexes = _pair()
    workers = 4
    feed = _Feed(indexes, workers)
    rng = random.Random(5)
    chains: list[tuple[int, list[int]]] = []
    h = 1
    while h < 120_000:
        w = rng.randrange(workers)
        chain = list(range(h, h + 500))
        h += 500
        feed.send(w, lambda eid, r, chain=chain: stored_blocks(eid, [block(x) for x in chain], rank=r))
        chains.append((w, chain))
        if rng.random() < 0.3:
            gone_w, gone = chains.pop(rng.randrange(len(chains)))
            feed.send(gone_w, lambda eid, r, gone=gone: removed(eid, gone[::-1], rank=r))
    _same(indexes, [c for _, c in chains[:20]] + [c[:64] for _, c in chains[-20:]], [])
    assert indexes[1].stats().distinct_blocks > 1 << 16
    # the entries were rewritten where they were, between batches and (importing a state,
    # node by node) inside one: every distance and fingerprint is a rebuild's
    compiled = indexes[1]
    again = CacheIndex.from_bytes(compiled.to_bytes(), core="compiled")
    for index in (compiled, again):
        layout = index._core.store_layout()  # type: ignore[attr-defined]
        assert layout["id_bits"] == 17, layout
        tables = index._core.check_tables()  # type: ignore[attr-defined]
        assert tables["engine"]["wrong"] == tables["content"]["wrong"] == 0, tables
        assert tables["engine"]["saturated"] > 0, "no saturated distance: the test misses that path"
    assert compiled._core.store_layout()["rebuilds_locked"] == 0  # type: ignore[attr-defined]
    assert again._core.store_layout()["rebuilds_locked"] >= 2  # type: ignore[attr-defined]
    assert again.same_state(compiled)
    for _, chain in chains[:50]:
        assert again.find_matches(chain) == compiled.find_matches(chain) != {}


def test_widened_entries_are_the_ones_a_rebuild_places() -> None:
    """Node ids gaining a bit rewrite each table entry in place (``table_widen_ids``: the id and
    distance move up, the fingerprint loses a bit) instead of rebuilding from every node. At
    every width from 16 to 31 id bits, the distance field narrowing past 24 and gone past 26
    included, the entry is exactly the one ``table_entry`` makes for the wider ids."""
    from kvevents.consumer._indexcore import widen_entry_mismatches

    assert widen_entry_mismatches(5000, 0x9E3779B97F4A7C15) == 0


def test_query_keys_of_every_width_are_read_exactly() -> None:
    """Keys at each boundary of CPython's 30-bit int digits, up to 2**64 - 1, match exactly
    their own blocks (a query list is converted lazily, in groups); out-of-range keys raise."""
    indexes = _pair()
    feed = _Feed(indexes, 1)
    keys = [0, 1, 2**30 - 1, 2**30, 2**60 - 1, 2**60, 2**62 + 5, 2**63, 2**64 - 1]
    for k in keys:
        feed.send(0, lambda eid, r, k=k: stored_blocks(eid, [block(k)], rank=r))
    for k in keys:
        for index in indexes:
            assert index.find_matches([k]) == {("i0", 0): 1}, k
            assert index.find_matches([k - 7 if k > 100 else k + 1000]) == {}, k
    for index in indexes:  # both cores alike: test_index_query_keys.py
        with pytest.raises(ValueError, match="query hash #0"):
            index.find_matches([2**64])
        with pytest.raises(ValueError, match="query hash #0"):
            index.find_matches([-1])


def _runs(index: CacheIndex) -> tuple[int, int]:
    layout = index._core.store_layout()
    return layout["holder_runs"], layout["holder_run_refs"]


def test_equal_holder_lists_share_one_run_copied_before_it_changes() -> None:
    """Workers storing one chain leave its nodes on one shared holder run; a change to one
    node's holders (a priority, a removal, a worker reset) copies the run for the nodes that
    change only, and the answers, the state and a state round trip stay the pure core's."""
    indexes = _pair()
    workers = 6
    feed = _Feed(indexes, workers)
    chain = list(range(70_000, 70_200))
    for w in range(workers):
        feed.send(w, lambda eid, r: stored_blocks(eid, [block(h) for h in chain], rank=r))
    assert _runs(indexes[1]) == (1, 200)  # each worker's event moved all 200 to one new run
    # the same holders come in the other order: an equal list (kept in slot order) on a run of
    # its own, made by other events than the chain's; its blocks share it
    twin = list(range(80_000, 80_050))
    for w in reversed(range(workers)):
        feed.send(w, lambda eid, r: stored_blocks(eid, [block(h) for h in twin], rank=r))
    assert _runs(indexes[1]) == (2, 250)
    assert indexes[1].find_matches(chain[:3] + twin) == indexes[0].find_matches(chain[:3] + twin)
    _same(indexes, [twin, chain], [])
    for w in range(workers):
        feed.send(w, lambda eid, r: removed(eid, twin, rank=r))
    assert _runs(indexes[1]) == (1, 200)
    _same(indexes, [chain, chain[:1], chain[150:]], [])
    feed.send(2, lambda eid, r: updated(eid, chain[100], priority=(35, 80), rank=r))
    assert _runs(indexes[1]) == (2, 200)  # block 100 alone on a copy
    _same(indexes, [chain, chain[99:102]], [])
    feed.send(3, lambda eid, r: removed(eid, chain[50:], rank=r))
    runs, refs = _runs(indexes[1])
    assert refs == 200 and runs <= 5, (runs, refs)
    _same(indexes, [chain, chain[40:60], chain[100:]], [])
    feed.send_all([created(feed.eid[0], rank=0)], feed.seq)  # worker 0's cache reset
    feed.seq += 1
    _same(indexes, [chain, chain[:60], chain[100:]], [])
    runs, refs = _runs(indexes[1])
    assert refs == 200 and runs <= 5, (runs, refs)
    again = CacheIndex.from_bytes(indexes[1].to_bytes(), core="compiled")
    assert again.same_state(indexes[0])
    assert _runs(again)[1] == 200 and _runs(again)[0] <= runs + 2, (_runs(again), runs)
    for q in [chain, chain[99:], chain[49:51]]:
        assert again.find_matches(q) == indexes[0].find_matches(q)


def test_deletions_keep_every_entry_distance_exact_under_churn() -> None:
    """An entry keeps its distance from home (saturated past 6) so that a deletion's backward
    shift reads no node for it: through heavy churn of random hashes, every entry's distance
    and fingerprint stay right (saturated ones among them), and both cores agree."""
    indexes = _pair()
    compiled = indexes[1]
    feed = _Feed(indexes, 2)
    rng = random.Random(11)
    live: list[tuple[int, int]] = []
    saturated = 0
    for step in range(2400):
        if len(live) > 2400 or (live and rng.random() < 0.5):
            gone = [live.pop(rng.randrange(len(live))) for _ in range(min(len(live), 8))]
            for w in (0, 1):
                mine = [x for owner, x in gone if owner == w]
                if mine:
                    feed.send(w, lambda eid, r, mine=mine: removed(eid, mine, rank=r))
        else:
            w = rng.randrange(2)
            xs = [rng.getrandbits(63) for _ in range(10)]
            feed.send(w, lambda eid, r, xs=xs: stored_blocks(eid, [block(x) for x in xs], rank=r))
            live += [(w, x) for x in xs]
        if step % 300 == 299:
            tables = compiled._core.check_tables()
            assert tables["engine"]["wrong"] == 0 and tables["content"]["wrong"] == 0, tables
            saturated += tables["engine"]["saturated"] + tables["content"]["saturated"]
    assert saturated > 0, "no distance ever saturated: the test misses that path"
    _same(indexes, [[x] for _, x in live[:100]], [])


KV_MIX = 0x9E3779B97F4A7C15  # the tables' multiplier before they were seeded


def test_engine_hashes_aimed_at_one_home_do_not_cluster() -> None:
    """A producer writes any engine hashes it likes. With the unseeded mix (key * KV_MIX, whose
    top 32 bits placed a key), hashes of the form (T << 32 | i) * KV_MIX**-1 all had one home:
    40,000 of them took 1.6 s to apply against 6 ms, every insert walking one cluster. The
    seeded mix places them like any others: the longest probe distance stays that of random keys."""
    aimed = [((0x12345678 << 32) | i) * pow(KV_MIX, -1, 2**64) % 2**64 for i in range(20_000)]
    rng = random.Random(5)
    longest = {}
    for name, hashes in (("aimed", aimed), ("random", [rng.getrandbits(64) for _ in aimed])):
        index = _compiled()
        events = [created(0)] + [stored_blocks(i + 1, [block(h)]) for i, h in enumerate(hashes)]
        index.apply(batch(events, 0))
        assert index.held_blocks() == len(hashes)
        tables = index._core.check_tables()
        assert tables["engine"]["wrong"] == 0
        longest[name] = tables["engine"]["longest"]
    assert longest["aimed"] < 200 and longest["random"] < 200, longest  # clustered, it was ~20,000


@pytest.mark.parametrize("order", ["oldest first", "newest first", "random"])
def test_one_content_under_thousands_of_engine_hashes_is_one_chain(order: str) -> None:
    """A producer may send one content under ever new engine hashes (constant tokens, random
    hashes: a hostile or a careless one). The content table used to hold one entry per node,
    in one run that every insert and removal of that content walked: 40,000 such blocks took
    0.28 s, 80,000 1.6 s (quadratic). Now it holds the content once, the head of a chain of
    its nodes; stores and removals in any order keep the chain whole, and the answers are the
    pure core's."""
    rng = random.Random(order)
    indexes = _pair()
    feed = _Feed(indexes, 3)
    same = [7, 7, 7, 7]
    hashes = [rng.getrandbits(64) for _ in range(3000)]
    for i in range(0, len(hashes), 100):  # one block per event: no parent, all one content
        w = i // 100 % 3
        events = []
        for h in hashes[i : i + 100]:
            events.append(stored_blocks(feed.eid[w], [block(h, tokens=same)], rank=w))
            feed.eid[w] += 1
        feed.send_all(events, feed.seq)
        feed.seq += 1
    compiled = indexes[1]
    content = compiled.content_hashes(same, 4)
    tables = compiled._core.check_tables()
    assert tables["content_chains"] == {"wrong": 0, "longest": 3000}, tables
    assert tables["content"]["longest"] < 50, tables  # one entry: no run to walk
    assert compiled._core.store_layout()["content_table_count"] == 1
    _same(indexes, [hashes[:5]], [content])
    victims = {"oldest first": hashes, "newest first": hashes[::-1]}.get(order) or rng.sample(
        hashes, len(hashes)
    )
    owner = {h: i // 100 % 3 for i, h in enumerate(hashes)}
    for k in range(0, 2990, 230):  # leave 10, removed a few at a time from every worker
        gone = victims[k : k + 230]
        for w in range(3):
            mine = [h for h in gone if owner[h] == w]
            if mine:
                feed.send(w, lambda eid, r, mine=mine: removed(eid, mine, rank=r))
        assert compiled._core.check_tables()["content_chains"]["wrong"] == 0
        _same(indexes, [], [content])
    left = victims[2990:]
    assert compiled._core.check_tables()["content_chains"] == {"wrong": 0, "longest": 10}
    assert set(compiled.find_matches_by_content(content)) == set(indexes[0].find_matches_by_content(content))
    assert all(compiled.find_matches([h]) for h in left)
    again = CacheIndex.from_bytes(compiled.to_bytes(), core="compiled")  # the chain is rebuilt on load
    assert again.same_state(compiled) and again._core.check_tables()["content_chains"]["longest"] == 10
