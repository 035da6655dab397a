"""The request bodies of ``route --serve`` (msgspec types: validation with messages that name the
field) and the scoring of one query against the index, leaving out stale and closed workers."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Annotated, Any

import msgspec
from msgspec import Meta

if TYPE_CHECKING:
    from kvevents.consumer import CacheIndex, WorkerKey

__all__ = ["HashesBody", "MatchBody", "score_query"]

HASH_MAX = (1 << 64) - 1
MAX_BATCH = 256

Token = Annotated[int, Meta(ge=0)]  # up to 64 bits (checked by the app: msgspec's bounds stop at
# int64); past 2**31 - 1 a token is a wide one (SGLang's multimodal pad values), hashed as the
# bridge stores it (kvevents.schemas.WIDE_TOKEN_ID)
Hash = Annotated[int, Meta(ge=0)]  # msgspec itself rejects more than 64 bits
LoraId = Annotated[int, Meta(ge=0)]
Weight = Annotated[float, Meta(ge=0.0, le=1.0)]
Window = Annotated[int, Meta(ge=1)]
BlockSize = Annotated[int, Meta(ge=1, le=1 << 20)]


class TokenPrompt(msgspec.Struct, forbid_unknown_fields=True):
    token_ids: list[Token]
    lora_id: LoraId | None = None


class HashPrompt(msgspec.Struct, forbid_unknown_fields=True):
    block_hashes: list[Hash]


class MatchBody(msgspec.Struct, forbid_unknown_fields=True):
    """``POST /match``: ``token_ids`` (one prompt) or ``prompts`` (a batch), not both."""

    token_ids: list[Token] | None = None
    prompts: Annotated[list[TokenPrompt], Meta(max_length=MAX_BATCH)] | None = None
    block_size: BlockSize | None = None
    lora_id: LoraId | None = None
    secondary_weight: Weight = 1.0
    window_size: Window | None = None


class HashesBody(msgspec.Struct, forbid_unknown_fields=True):
    """``POST /match/hashes``: ``block_hashes`` (the engine's, one prompt) or ``prompts``."""

    block_hashes: list[Hash] | None = None
    prompts: Annotated[list[HashPrompt], Meta(max_length=MAX_BATCH)] | None = None
    secondary_weight: Weight = 1.0
    window_size: Window | None = None


def score_query(
    index: CacheIndex,
    hashes: Sequence[int],
    *,
    by_content: bool,
    secondary_weight: float,
    window_size: int | None,
    left_out: Mapping[WorkerKey, str],
    degraded: frozenset[WorkerKey],
) -> dict[str, Any]:
    """One answer: ``blocks``, ``scores`` best first (each with its ``degraded`` flag), ``best``,
    and ``left_out``: workers that matched but are stale or closed (not routed to)."""
    details = index.match_details(hashes, by_content=by_content, window_size=window_size)
    ranked = []
    skipped = []
    for key, (blocks, primary) in details.items():
        if blocks <= 0:
            continue
        if left_out and key in left_out:
            skipped.append({"instance_id": key[0], "attention_dp_rank": key[1], "state": left_out[key],
                            "matched_blocks": blocks})  # fmt: skip
            continue
        score = (
            float(blocks)
            if secondary_weight == 1.0
            else round(primary + secondary_weight * (blocks - primary), 6)
        )
        ranked.append((-score, -blocks, key[0], key[1], primary))
    ranked.sort()  # best first: score, then matched blocks, then worker key
    scores = [
        {"instance_id": instance, "attention_dp_rank": rank, "matched_blocks": -negative_blocks,
         "primary_blocks": primary, "score": -negative_score, "degraded": (instance, rank) in degraded}
        for negative_score, negative_blocks, instance, rank, primary in ranked
    ]  # fmt: skip
    skipped.sort(key=lambda s: (s["instance_id"], s["attention_dp_rank"]))
    return {
        "blocks": len(hashes),
        "scores": scores,
        "best": scores[0] if scores else None,
        "left_out": skipped,
    }
