"""The fast path of ``route --serve``: the compiled ``_route_fast`` against its pure twin
``_route_fastpy`` and the reference (``hashing``, msgspec, ``score_query``), on generated and
hostile inputs; the answer table after new workers and slots; ``CacheIndex``'s slot table."""

from __future__ import annotations

import json
import random
from array import array

import msgspec
import pytest
from cli_events import batch, created
from hypothesis import given, settings
from hypothesis import strategies as st
from kvevents.consumer import CacheIndex, WorkerKey
from kvevents.consumer.hashing import content_hashes_for_tokens
from kvevents.schemas import KVCacheEvent, KVCacheStoredBlockData, KVCacheStoredData

from kvevents.commands import _route_fast as compiled
from kvevents.commands import _route_fastpy as pure
from kvevents.commands._route_answer import FastAnswers, build_table
from kvevents.commands._route_requests import score_query

TOKEN_MAX = (1 << 31) - 1
tokens_st = st.lists(st.integers(0, TOKEN_MAX) | st.integers(0, 50_000), max_size=80)


@settings(max_examples=300, deadline=None)
@given(tokens=tokens_st, block_size=st.integers(1, 9), lora=st.none() | st.integers(0, 1 << 62),
       spaces=st.sampled_from(["", " ", "\n\t ", "\r\n"]))  # fmt: skip
def test_token_hashes_equal_the_reference(tokens: list[int], block_size: int, lora: int | None, spaces: str) -> None:  # fmt: skip
    raw = ("[" + spaces + ("," + spaces).join(map(str, tokens)) + spaces + "]").encode()
    want = array("Q", content_hashes_for_tokens(tokens, block_size, lora))
    assert compiled.hash_token_json(raw, block_size, lora) == want
    assert pure.hash_token_json(raw, block_size, lora) == want
    body = {"token_ids": tokens} | ({} if lora is None else {"lora_id": lora})
    raw_body = json.dumps(body, indent=1 if spaces else None).encode()
    assert compiled.parse_match_body(raw_body, block_size) == ([want], None, False)
    assert pure.parse_match_body(raw_body, block_size) == ([want], None, False)


@pytest.mark.parametrize(
    "raw",
    [b"", b"[", b"]", b"[1,]", b"[,1]", b"[1 2]", b"[-1]", b"[1.0]", b"[1e3]", b"[01]", b"[2147483648]",
     b"[99999999999999999999999]", b'["1"]', b"[[1]]", b"[1] x", b"{}", b"null", b"[true]", b"[1,,2]"],
)  # fmt: skip
def test_token_arrays_that_are_not_plain_give_none(raw: bytes) -> None:
    assert compiled.hash_token_json(raw, 2, None) is None
    assert pure.hash_token_json(raw, 2, None) is None


@pytest.mark.parametrize("lora", [1 << 64, (1 << 64) + 5, -1])
def test_a_lora_id_outside_64_bits_gives_none_not_its_low_bits(lora: int) -> None:
    """The general path names it (the compiled twin kept its low 64 bits, the Python one raised)."""
    assert compiled.hash_token_json(b"[1, 2, 3, 4]", 2, lora) is None
    assert pure.hash_token_json(b"[1, 2, 3, 4]", 2, lora) is None
    top = (1 << 64) - 1
    want = array("Q", content_hashes_for_tokens([1, 2, 3, 4], 2, top))
    assert (
        compiled.hash_token_json(b"[1, 2, 3, 4]", 2, top)
        == pure.hash_token_json(b"[1, 2, 3, 4]", 2, top)
        == want
    )


@pytest.mark.parametrize(
    "raw",
    [
        b'{"token_ids": [1], "prompts": []}',  # both forms
        b'{"prompts": [{"token_ids": [1], "lora_id": null}]}',
        b'{"prompts": [{"token_ids": [1], "x": 1}]}',
        b'{"prompts": [{"lora_id": 1}]}',
        b'{"prompts": [[1]]}',
        b'{"prompts": {}}',
        b'{"prompts": [' + b",".join([b'{"token_ids": [1]}'] * 257) + b"]}",  # the general path says why
        b'{"token_ids": [1], "secondary_weight": 0.5}',
        b'{"token_ids": [1], "tokens": [1]}',  # an unknown field: the general path names it
        b'{"token_ids": [1], "block_size": null}',
        b'{"token_ids": [1], "block_size": 0}',
        b'{"token_ids": [1], "block_size": 2.0}',
        b'{"token_ids": [1], "block_size": 1048577}',
        b'{"token_ids": [1], "window_size": 0}',
        b'{"token_ids": [1], "lora_id": -1}',
        b'{"token_ids": [1], "lora_id": true}',
        b'{"token_ids": [-1]}',
        b'{"token_ids": "12"}',
        b'{"block_size": 4}',
        b'{"token_ids": [1]} trailing',
        b'{"token_ids": [1],}',
        b"[1, 2]",
        b"{not json",
        b'{"token_ids": ' + b"[" * 5000 + b"]" * 5000 + b"}",  # the Python twin raised RecursionError
        b"[" * 5000 + b"]" * 5000,
    ],
)
def test_bodies_that_are_not_plain_give_none(raw: bytes) -> None:
    assert compiled.parse_match_body(raw, 4) is None
    assert pure.parse_match_body(raw, 4) is None


@settings(max_examples=150, deadline=None)
@given(prompts=st.lists(st.tuples(tokens_st, st.none() | st.integers(0, 1 << 62)), max_size=6),
       top_lora=st.none() | st.integers(0, 1000), block_size=st.integers(1, 5),
       window=st.none() | st.integers(1, 4096))  # fmt: skip
def test_batches_equal_the_reference(prompts: list[tuple[list[int], int | None]], top_lora: int | None, block_size: int, window: int | None) -> None:  # fmt: skip
    items = [{"token_ids": t} | ({} if lora is None else {"lora_id": lora}) for t, lora in prompts]
    body: dict[str, object] = {"prompts": items, "block_size": block_size}
    if top_lora is not None:
        body["lora_id"] = top_lora
    if window is not None:
        body["window_size"] = window
    want = [
        array("Q", content_hashes_for_tokens(t, block_size, lora if lora is not None else top_lora))
        for t, lora in prompts
    ]
    raw = json.dumps(body).encode()
    assert compiled.parse_match_body(raw, 99) == (want, window, True)
    assert pure.parse_match_body(raw, 99) == (want, window, True)


def test_nineteen_digit_lora_ids_parse() -> None:
    want = ([array("Q", content_hashes_for_tokens([1, 2], 2, 10**18))], None, False)
    for twin in (compiled, pure):
        assert twin.parse_match_body(b'{"token_ids": [1, 2], "lora_id": 1000000000000000000}', 2) == want


def test_escaped_or_repeated_keys_are_left_to_msgspec() -> None:
    """The compiled parser does not unescape keys nor resolve repeats: None, the general path."""
    for raw in (b'{"token\\u005fids": [1, 2]}', b'{"token_ids": [1], "token_ids": [2]}'):
        assert compiled.parse_match_body(raw, 1) is None


@settings(max_examples=300, deadline=None)
@given(data=st.binary(max_size=60) | st.text(alphabet='{}[]":,0123456789 _tokenidsblcwzra-.e', max_size=60).map(str.encode))  # fmt: skip
def test_arbitrary_bytes_either_none_or_the_reference(data: bytes) -> None:
    for fast in (compiled.parse_match_body(data, 3), pure.parse_match_body(data, 3)):
        if fast is not None:
            body = msgspec.json.decode(data)
            queries = [
                (p["token_ids"], p.get("lora_id", body.get("lora_id"))) for p in body.get("prompts", [body])
            ]
            want = [content_hashes_for_tokens(t, body.get("block_size", 3), lora) for t, lora in queries]
            assert ([list(h) for h in fast[0]], fast[1], fast[2]) == (
                want,
                body.get("window_size"),
                "prompts" in body,
            )
    got = compiled.hash_token_json(data, 2, None)
    assert got == pure.hash_token_json(data, 2, None)


def _random_table(rng: random.Random, workers: int, slots: int) -> tuple[list[int], list[bytes], list[bytes | None], list[bool]]:  # fmt: skip
    keys = sorted(WorkerKey(f"engine-{rng.randrange(workers)}-{i}", rng.randrange(4)) for i in range(workers))
    heads = [
        b'{"instance_id":"%s","attention_dp_rank":%d,"matched_blocks":' % (k[0].encode(), k[1]) for k in keys
    ]
    lefts: list[bytes | None] = [
        None
        if rng.random() < 0.7
        else b'{"instance_id":"%s","state":"stale","matched_blocks":' % k[0].encode()
        for k in keys
    ]
    return [rng.randrange(workers) for _ in range(slots)], heads, lefts, [rng.random() < 0.2 for _ in keys]


@pytest.mark.parametrize("seed", range(40))
def test_rendered_answers_equal_between_twins(seed: int) -> None:
    rng = random.Random(seed)
    workers, slots = rng.randrange(1, 30), rng.randrange(1, 60)
    parts = _random_table(rng, workers, slots)
    fast, slow = compiled.AnswerTable(*parts), pure.AnswerTable(*parts)
    for _ in range(20):
        chosen = sorted(rng.sample(range(slots), rng.randrange(0, slots + 1)))
        matches = [(s, r, rng.randrange(0, r + 1)) for s in chosen for r in [rng.randrange(0, 70)]]
        weight = rng.choice([1.0, 0.0, 0.5, rng.random()])
        blocks = rng.randrange(0, 70)
        got = fast.render(matches, blocks, weight)
        assert got is not None and got == slow.render(matches, blocks, weight)
        json.loads(got)
    assert fast.render([(slots, 1, 1)], 1, 1.0) is None and slow.render([(slots, 1, 1)], 1, 1.0) is None


def test_bad_tables_are_refused() -> None:
    for twin in (compiled, pure):
        with pytest.raises(ValueError, match="slot 0 names worker 3"):
            twin.AnswerTable([3], [b"x"], [None], [False])
        with pytest.raises(ValueError, match="one entry per worker"):
            twin.AnswerTable([0], [b"x"], [None, None], [False])


def _store(index: CacheIndex, instance: str, tokens: list[int], blocks: int, level: int = 0, dp: int = 1) -> None:  # fmt: skip
    hashes = content_hashes_for_tokens(tokens, 4)
    stored = [
        KVCacheStoredBlockData(hashes[i], tokens[i * 4 : (i + 1) * 4], cache_level=level)
        for i in range(blocks)
    ]
    events = [created(0, 0), KVCacheEvent(1, KVCacheStoredData(None, stored), 64, 0)]
    index.apply(batch(events, 0, instance=instance, dp=dp))


@pytest.mark.parametrize("weight", [1.0, 0.5, 0.0])
def test_answers_equal_score_query_as_workers_and_slots_arrive(weight: float) -> None:
    rng = random.Random(3)
    prompt = [rng.randrange(50_000) for _ in range(40)]
    index = CacheIndex()
    fast = FastAnswers(index, 4)
    for step, name in enumerate(["c", "a", "stale", "b", "d", "e"]):
        _store(index, name, prompt, rng.randrange(1, 11), level=step % 2, dp=1 + step % 2)
        left_out = {k: "stale" for k in index.workers() if k.instance_id == "stale"}
        degraded = frozenset(k for k in index.workers() if k.instance_id == "a")
        if step % 2:  # every other step the table is refreshed; otherwise a new slot rebuilds it
            fast.refresh(left_out, degraded)
        else:
            fast._exclusions = (left_out, degraded)
        for tokens in (prompt, prompt[:17], prompt[:8] + [1] * 30, [7] * 12):
            hashes = content_hashes_for_tokens(tokens, 4)
            want = score_query(index, hashes, by_content=True, secondary_weight=weight, window_size=None,
                               left_out=left_out, degraded=degraded)  # fmt: skip
            got = fast.match(array("Q", hashes), True, None, weight)
            assert json.loads(got) == want
            if weight == 1.0:
                assert got == msgspec.json.encode(want)  # the same bytes as before
    assert (
        build_table(index, 0, {}, frozenset()).render([], 0, 1.0)
        == b'{"blocks":0,"scores":[],"best":null,"left_out":[]}'
    )


def test_cache_index_slot_table_follows_new_slots() -> None:
    index = CacheIndex()
    prompt = list(range(100, 140))
    _store(index, "x", prompt, 5)
    assert index.match_details(content_hashes_for_tokens(prompt, 4), by_content=True)
    for name in ("y", "z"):
        _store(index, name, prompt, 7, dp=2)
    core = index._core
    slots = [s for s, _, _ in core.match(content_hashes_for_tokens(prompt, 4), True, None, 15)]
    assert [index._slot_worker(s) for s in slots] == [WorkerKey(*core.slot_key(s)[:2]) for s in slots]
    details = index.match_details(content_hashes_for_tokens(prompt, 4), by_content=True)
    assert {k.instance_id: m.blocks for k, m in details.items()} == {"x": 5, "y": 7, "z": 7}
