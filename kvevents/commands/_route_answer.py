"""The fast path of ``route --serve``'s ``/match`` answers: the request decoded with the token
array left as JSON text (hashed in compiled code, no Python int per token), the index core's
per-slot match, and the answer rendered from an :class:`AnswerTable` of per-worker JSON pieces
(rebuilt with the exclusions, and when a new cache slot appears). A body in the plain
form is parsed in one pass; anything unusual (an error, a field of an unusual form) returns None
and the general path answers, with its messages."""

from __future__ import annotations

from array import array
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Annotated, Any

import msgspec
from kvevents.consumer._state import LEVEL_MAX
from kvevents.schemas.codec import pure_python_forced
from msgspec import Meta

from kvevents.commands._route_requests import MAX_BATCH, BlockSize, LoraId, Weight, Window

if TYPE_CHECKING:
    from kvevents.consumer import CacheIndex, WorkerKey

if TYPE_CHECKING:  # the twins have the same interface (the tests hold them equal)
    from kvevents.commands._route_fastpy import AnswerTable, hash_token_json, parse_match_body
else:
    try:
        if pure_python_forced():
            raise ImportError("KVEVENTS_PURE_PYTHON is set")
        from kvevents.commands._route_fast import AnswerTable, hash_token_json, parse_match_body
    except ImportError:
        from kvevents.commands._route_fastpy import AnswerTable, hash_token_json, parse_match_body

COMPILED = AnswerTable.__module__.endswith("_route_fast")
"""Whether the compiled fast path (``_route_fast``) serves."""


__all__ = ["COMPILED", "FastAnswers", "build_table"]

_EMPTY = msgspec.Raw(b"")


class _RawPrompt(msgspec.Struct, forbid_unknown_fields=True):
    token_ids: msgspec.Raw
    lora_id: LoraId | None = None


class _RawMatchBody(msgspec.Struct, forbid_unknown_fields=True):
    """:class:`._route_requests.MatchBody` with the token arrays left as JSON text."""

    token_ids: msgspec.Raw = _EMPTY
    prompts: Annotated[list[_RawPrompt], Meta(max_length=MAX_BATCH)] | None = None
    block_size: BlockSize | None = None
    lora_id: LoraId | None = None
    secondary_weight: Weight = 1.0
    window_size: Window | None = None


_DECODE = msgspec.json.Decoder(_RawMatchBody).decode


def _head(key: WorkerKey) -> bytes:
    return (
        msgspec.json.encode({"instance_id": key[0], "attention_dp_rank": key[1]})[:-1] + b',"matched_blocks":'
    )


def _left(key: WorkerKey, state: str) -> bytes:
    piece = msgspec.json.encode({"instance_id": key[0], "attention_dp_rank": key[1], "state": state})
    return piece[:-1] + b',"matched_blocks":'


def build_table(
    index: CacheIndex,
    slots: int,
    left_out: Mapping[WorkerKey, str],
    degraded: frozenset[WorkerKey],
    heads: dict[WorkerKey, bytes] | None = None,
) -> AnswerTable:
    """The table of ``index``'s first ``slots`` cache slots and their workers (only a worker
    with a slot can match), now; ``heads``: JSON pieces kept from earlier tables (added to)."""
    heads = {} if heads is None else heads
    slot_keys = [index._slot_worker(s) for s in range(slots)]  # cached by the index
    keys = sorted(set(slot_keys))
    number = {key: i for i, key in enumerate(keys)}
    for key in keys:
        if key not in heads:
            heads[key] = _head(key)
    return AnswerTable(
        [number[k] for k in slot_keys],
        [heads[k] for k in keys],
        [None if k not in left_out else _left(k, left_out[k]) for k in keys],
        [k in degraded for k in keys],
    )


class FastAnswers:
    """``POST /match`` answers by the fast path, for one index (call under the index's lock)."""

    def __init__(self, index: CacheIndex, default_block_size: int) -> None:
        self.index = index
        self.block_size = default_block_size
        self._heads: dict[WorkerKey, bytes] = {}
        self.table = build_table(index, 0, {}, frozenset(), self._heads)
        self._exclusions: tuple[Mapping[Any, str], frozenset[Any]] = ({}, frozenset())

    def refresh(self, left_out: Mapping[WorkerKey, str], degraded: frozenset[WorkerKey]) -> None:
        """Rebuild the table with these exclusions (keeping the slots it knows), if they changed."""
        if (left_out, degraded) == self._exclusions:
            return
        self._exclusions = (left_out, degraded)
        self.table = build_table(self.index, self.table.slots, left_out, degraded, self._heads)

    def plain(self, raw: bytes) -> tuple[list[array[int]], int | None, bool] | None:
        """A body in its plain form, parsed in one pass: content hashes per prompt, window size,
        whether it is the batch form; None for any other body."""
        return parse_match_body(raw, self.block_size)

    def decode(self, raw: bytes) -> _RawMatchBody | None:
        """The body, or None to leave it (and its error message) to the general path."""
        try:
            body = _DECODE(raw)
        except (msgspec.DecodeError, RecursionError):
            return None
        if (len(body.token_ids) == 0) == (body.prompts is None):
            return None
        return body

    def hashes_of(self, body: _RawMatchBody) -> list[array[int]] | None:
        """Each prompt's content hashes (no index needed: hash before taking its lock), or None
        (a token array that is not plain) for the general path."""
        block_size = body.block_size or self.block_size
        if body.prompts is None:
            one = hash_token_json(body.token_ids, block_size, body.lora_id)
            return None if one is None else [one]
        queries = []
        for prompt in body.prompts:
            lora = prompt.lora_id if prompt.lora_id is not None else body.lora_id
            hashes = hash_token_json(prompt.token_ids, block_size, lora)
            if hashes is None:
                return None
            queries.append(hashes)
        return queries

    def match(self, hashes: Sequence[int], by_content: bool, window_size: int | None, weight: float) -> bytes:
        """One answer's JSON: the same as ``score_query``'s, encoded."""
        core = self.index._core  # the per-slot match: CacheIndex.match_details without its dict
        matches = core.match(hashes, by_content, window_size, LEVEL_MAX)
        answer = self.table.render(matches, len(hashes), weight)
        if answer is None:  # a cache slot newer than the table
            slots = max(slot for slot, _, _ in matches) + 1
            self.table = build_table(self.index, slots, *self._exclusions, self._heads)
            answer = self.table.render(matches, len(hashes), weight)
            assert answer is not None
        return answer
