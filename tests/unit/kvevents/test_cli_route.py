"""``kvevents route``: prompt files, scoring and the request format (the HTTP server: test_route_http.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from cli_events import batch, created
from kvevents.consumer import CacheIndex
from kvevents.schemas import KVCacheEvent, KVCacheStoredBlockData, KVCacheStoredData

from kvevents.commands._routing import parse_match_request, parse_token_line, read_token_file, score_prompt

BS = 4
PROMPT = list(range(100, 116))  # four blocks of 4 tokens


def store_prefix(
    index: CacheIndex, instance: str, rank: int, tokens: list[int], blocks: int, level: int = 0
) -> None:
    """The worker stores the first ``blocks`` blocks of ``tokens`` (engine hashes made up)."""
    stored = [
        KVCacheStoredBlockData(
            hash((instance, rank, i)) & 0xFFFFFFFF, tokens[i * BS : (i + 1) * BS], cache_level=level
        )
        for i in range(blocks)
    ]
    events = [created(0, rank), KVCacheEvent(1, KVCacheStoredData(None, stored), 64, rank)]
    index.apply(batch(events, 0, instance=instance, dp=1 if rank == 0 else rank + 1))


@pytest.fixture
def index() -> CacheIndex:
    idx = CacheIndex()
    store_prefix(idx, "a", 0, PROMPT, 2)
    store_prefix(idx, "b", 0, PROMPT, 4)
    store_prefix(idx, "c", 0, PROMPT, 3, level=1)  # offloaded
    store_prefix(idx, "d", 0, [9] * 16, 4)  # other content
    return idx


def test_token_lines_in_every_accepted_form() -> None:
    assert parse_token_line("1 2  3", "f:1") == [1, 2, 3]
    assert parse_token_line("1,2, 3", "f:1") == [1, 2, 3]
    assert parse_token_line("[4, 5]", "f:1") == [4, 5]
    with pytest.raises(ValueError, match=r"f:7: 'x' is not a token id"):
        parse_token_line("1 x", "f:7")
    with pytest.raises(ValueError, match="outside"):
        parse_token_line("-1", "f:1")
    with pytest.raises(ValueError, match="integers"):
        parse_token_line("[1, 2.5]", "f:1")
    with pytest.raises(ValueError, match="JSON list"):
        parse_token_line("[1, 2", "f:1")


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("[" * 100_000, "too large or too deep"),  # RecursionError before
        ("[" + "9" * 5000 + "]", "too large or too deep"),  # int() past 4,300 digits
        ("1 " + "9" * 5000, "too many digits"),  # StopIteration before
        ("[1, " + "9" * 400 + "]", r"token id 9{30,}\.\.\.9+ is outside"),  # quoted cut short
    ],
)
def test_token_lines_too_deep_or_too_long_are_named_errors(line: str, message: str) -> None:
    with pytest.raises(ValueError, match=message) as caught:
        parse_token_line(line, "f:2")
    assert str(caught.value).startswith("f:2: ") and len(str(caught.value)) < 200


def test_token_file_skips_comments_and_names_lines(tmp_path: Path) -> None:
    path = tmp_path / "p.txt"
    path.write_text("# prompts\n1 2 3\n\n[4]\n")
    prompts = read_token_file(path, lora_id=3)
    assert [(p.name, p.tokens, p.lora_id) for p in prompts] == [
        ("p.txt:2", [1, 2, 3], 3),
        ("p.txt:4", [4], 3),
    ]
    path.write_text("# nothing\n")
    with pytest.raises(ValueError, match="no prompt"):
        read_token_file(path)
    with pytest.raises(ValueError, match="cannot read"):
        read_token_file(tmp_path / "missing.txt")


def test_scores_best_first_with_secondary_weight(index: CacheIndex) -> None:
    blocks, scores = score_prompt(index, PROMPT, BS)
    assert blocks == 4
    assert [(s.instance_id, s.matched_blocks, s.primary_blocks) for s in scores] == [
        ("b", 4, 4),
        ("c", 3, 0),
        ("a", 2, 2),
    ]
    _, weighted = score_prompt(index, PROMPT, BS, secondary_weight=0.5)
    assert [(s.instance_id, s.score) for s in weighted] == [("b", 4.0), ("a", 2.0), ("c", 1.5)]
    assert score_prompt(index, [7] * 16, BS) == (4, [])
    assert score_prompt(index, PROMPT, BS, lora_id=5)[1] == []  # another LoRA: other content


def test_match_request_validation() -> None:
    request = parse_match_request(b'{"token_ids": [1, 2], "block_size": 16, "lora_id": null}', 32)
    assert (request.token_ids, request.block_size, request.lora_id) == ([1, 2], 16, None)
    assert parse_match_request(b'{"token_ids": []}', 32).block_size == 32
    for body, message in [
        (b"nope", "not JSON"),
        (b"[1, 2]", "JSON object"),
        (b"{}", "'token_ids' is missing"),
        (b'{"token_ids": "12"}', "JSON list"),
        (b'{"token_ids": [1, "2"]}', "integers"),
        (b'{"token_ids": [1], "block_size": 0}', "'block_size' must be an integer >= 1"),
        (b'{"token_ids": [1], "lora_id": -1}', "'lora_id'"),
        (b'{"token_ids": [1], "secondary_weight": 2}', "within 0..1"),
        (b'{"token_ids": [1], "tokens": [1]}', "unknown field"),
        (b'{"token_ids": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "nested too deeply"),
    ]:
        with pytest.raises(ValueError, match=message):
            parse_match_request(body, 32)
