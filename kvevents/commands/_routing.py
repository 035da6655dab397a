"""Routing with the index: prompts from files, per-worker scores, and the ``POST /match``
request format of ``route --serve``."""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvevents._brief import brief

if TYPE_CHECKING:
    from kvevents.consumer import CacheIndex

__all__ = ["MatchRequest", "Prompt", "Score", "parse_match_request", "read_token_file", "score_prompt"]

TOKEN_MAX = (1 << 64) - 1
"""Token ids past 2**31 - 1 are wide ones (SGLang's multimodal pad values), hashed as the bridge
stores them (``kvevents.schemas.WIDE_TOKEN_ID``)."""


@dataclass(frozen=True)
class Prompt:
    """A prompt to route: its token ids and LoRA id, and where it came from."""

    name: str
    tokens: list[int]
    lora_id: int | None = None


@dataclass(frozen=True)
class Score:
    """One worker's match: the contiguous run of leading blocks it holds, and its score."""

    instance_id: str
    attention_dp_rank: int
    matched_blocks: int
    primary_blocks: int
    score: float

    def to_json(self) -> dict[str, Any]:
        return {
            "instance_id": self.instance_id,
            "attention_dp_rank": self.attention_dp_rank,
            "matched_blocks": self.matched_blocks,
            "primary_blocks": self.primary_blocks,
            "score": self.score,
        }


def _check_tokens(values: Iterable[Any], where: str) -> list[int]:
    tokens = []
    for value in values:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{where}: token ids must be integers, got {brief(value)}")
        if not 0 <= value <= TOKEN_MAX:
            raise ValueError(f"{where}: token id {brief(value)} is outside 0..{TOKEN_MAX}")
        tokens.append(value)
    return tokens


def parse_token_line(line: str, where: str) -> list[int]:
    """One prompt: a JSON list of ints, or ints separated by whitespace and/or commas."""
    text = line.strip()
    if text.startswith("["):
        try:
            values = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{where}: not a JSON list of token ids ({exc.msg})") from None
        except (ValueError, RecursionError):  # an int of over 4,300 digits, or nesting
            raise ValueError(
                f"{where}: not a JSON list of token ids (a value too large or too deep)"
            ) from None
        if not isinstance(values, list):
            raise ValueError(f"{where}: expected a JSON list of token ids")
        return _check_tokens(values, where)
    words = text.replace(",", " ").split()
    try:
        return _check_tokens((int(w) for w in words), where)
    except ValueError as exc:
        if "token id" in str(exc):
            raise
        bad = next((w for w in words if not w.lstrip("-").isdigit()), None)
        if bad is None:  # digits only: an int too long to read
            raise ValueError(f"{where}: a token id has too many digits") from None
        raise ValueError(f"{where}: {brief(bad)} is not a token id") from None


def read_token_file(path: str | Path, lora_id: int | None = None) -> list[Prompt]:
    """Prompts of a file, one per line (blank lines and lines starting with '#' skipped)."""
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ValueError(f"{path}: cannot read: {exc.strerror or exc}") from None
    prompts = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        tokens = parse_token_line(line, f"{path}:{number}")
        prompts.append(Prompt(f"{Path(path).name}:{number}", tokens, lora_id))
    if not prompts:
        raise ValueError(f"{path}: no prompt in the file")
    return prompts


def score_prompt(
    index: CacheIndex,
    tokens: list[int],
    block_size: int,
    lora_id: int | None = None,
    *,
    secondary_weight: float = 1.0,
    window_size: int | None = None,
) -> tuple[int, list[Score]]:
    """The query's number of full blocks and, per worker holding its first block, its match,
    best first (score, then matched blocks, then worker key). ``secondary_weight`` (0..1) is
    what a block held only at a secondary level is worth (1: the same as a primary one)."""
    hashes = index.content_hashes(tokens, block_size, lora_id)
    details = index.match_details(hashes, by_content=True, window_size=window_size)
    scores = [
        Score(
            key.instance_id,
            key.attention_dp_rank,
            match.blocks,
            match.primary_blocks,
            round(match.score(secondary_weight), 6),
        )
        for key, match in details.items()
        if match.blocks > 0
    ]
    scores.sort(key=lambda s: (-s.score, -s.matched_blocks, s.instance_id, s.attention_dp_rank))
    return len(hashes), scores


@dataclass(frozen=True)
class MatchRequest:
    """A ``POST /match`` body."""

    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    secondary_weight: float = 1.0
    window_size: int | None = None


def _optional_int(body: dict[str, Any], name: str, minimum: int) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"'{name}' must be an integer >= {minimum} or null, got {brief(value)}")
    return value


def parse_match_request(raw: bytes, default_block_size: int) -> MatchRequest:
    """Validate a ``POST /match`` body; ``ValueError`` with a message for the client."""
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"the body is not JSON: {exc}") from None
    except RecursionError:
        raise ValueError("the body is JSON nested too deeply") from None
    if not isinstance(body, dict):
        raise ValueError('the body must be a JSON object like {"token_ids": [1, 2, 3], "block_size": 32}')
    unknown = sorted(set(body) - {"token_ids", "block_size", "lora_id", "secondary_weight", "window_size"})
    if unknown:
        raise ValueError(
            f"unknown field(s) {unknown}; known: token_ids, block_size, lora_id, secondary_weight, window_size"
        )
    if "token_ids" not in body:
        raise ValueError("'token_ids' is missing (a JSON list of token ids)")
    if not isinstance(body["token_ids"], list):
        raise ValueError("'token_ids' must be a JSON list of token ids")
    tokens = _check_tokens(body["token_ids"], "'token_ids'")
    block_size = _optional_int(body, "block_size", 1) or default_block_size
    weight = body.get("secondary_weight", 1.0)
    if isinstance(weight, bool) or not isinstance(weight, int | float) or not 0.0 <= weight <= 1.0:
        raise ValueError(f"'secondary_weight' must be a number within 0..1, got {brief(weight)}")
    return MatchRequest(
        tokens,
        block_size,
        _optional_int(body, "lora_id", 0),
        float(weight),
        _optional_int(body, "window_size", 1),
    )
