"""The pure-Python twin of :mod:`._route_fast` (and its specification: both give the same bytes):
content hashes from the JSON text of a token array, and one ``/match`` answer rendered as JSON
from precomputed per-worker pieces. ``tests/unit/kvevents/test_route_fast.py`` holds them equal."""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from typing import Annotated

import msgspec
from kvevents.consumer.hashing import content_hashes_for_tokens
from msgspec import Meta

__all__ = ["AnswerTable", "hash_token_json", "parse_match_body"]

_TOKENS = msgspec.json.Decoder(list[Annotated[int, Meta(ge=0, le=(1 << 31) - 1)]])


def hash_token_json(raw: bytes | memoryview | msgspec.Raw, block_size: int, lora_id: int | None) -> array[int] | None:  # fmt: skip
    """``array('Q')`` of the chained content hashes of the full blocks of the tokens in ``raw``
    (the JSON text of an array of token ids), or None if it is not a plain array of integers in
    0..2**31-1 (written as JSON integers: no fraction, exponent or leading zero) or ``lora_id``
    is outside 0..2**64-1 (the general path names it)."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    if lora_id is not None and not 0 <= lora_id <= _U64_MAX:
        return None
    text = bytes(raw)
    if not _plain_integers(text):
        return None
    try:
        tokens = _TOKENS.decode(text)
    except msgspec.DecodeError:
        return None
    return array("Q", content_hashes_for_tokens(tokens, block_size, lora_id))


_TOKEN_MAX = (1 << 31) - 1
_U64_MAX = (1 << 64) - 1
_PLAIN_LIMITS = {"block_size": (1, 1 << 20), "lora_id": (0, 1 << 62), "window_size": (1, _TOKEN_MAX)}
_MAX_PROMPTS = 256


def _plain_int(body: dict[str, object], name: str, low: int, high: int) -> bool:
    value = body.get(name, low)
    return type(value) is int and low <= value <= high


def _plain_tokens(value: object) -> bool:
    return type(value) is list and all(type(t) is int and 0 <= t <= _TOKEN_MAX for t in value)


def parse_match_body(
    raw: bytes | memoryview, default_block_size: int
) -> tuple[list[array[int]], int | None, bool] | None:
    """A ``POST /match`` body in its plain form: an object of ``token_ids`` (integers in
    0..2**31-1) or ``prompts`` (up to 256 objects of ``token_ids`` and optionally ``lora_id``),
    and optionally ``block_size`` (1..2**20), ``lora_id`` (0..2**62) and ``window_size``
    (1..2**31-1), each an integer. ``(list of array('Q') of content hashes, one per prompt;
    window_size or None; whether it is the batch form)``, or None for any other body (the
    general path decodes it, and names what is wrong). The compiled twin may also return None
    for a body of this form written unusually (escaped or repeated keys)."""
    try:
        body = msgspec.json.decode(bytes(raw))
    except (msgspec.DecodeError, RecursionError):
        return None
    if not isinstance(body, dict) or ("token_ids" in body) == ("prompts" in body):
        return None
    if not set(body) <= {"token_ids", "prompts", *_PLAIN_LIMITS}:
        return None
    if not all(_plain_int(body, name, *limits) for name, limits in _PLAIN_LIMITS.items()):
        return None
    if "token_ids" in body:
        queries = [(body["token_ids"], body.get("lora_id"))]
    else:
        prompts = body["prompts"]
        if type(prompts) is not list or len(prompts) > _MAX_PROMPTS:
            return None
        for prompt in prompts:
            if (
                type(prompt) is not dict
                or "token_ids" not in prompt
                or not set(prompt) <= {"token_ids", "lora_id"}
            ):
                return None
            if not _plain_int(prompt, "lora_id", *_PLAIN_LIMITS["lora_id"]):
                return None
        queries = [(p["token_ids"], p.get("lora_id", body.get("lora_id"))) for p in prompts]
    if not all(_plain_tokens(tokens) for tokens, _ in queries):
        return None
    if default_block_size <= 0 and "block_size" not in body:
        raise ValueError(f"block_size must be positive, got {default_block_size}")
    block_size = body.get("block_size", default_block_size)
    hashes = [array("Q", content_hashes_for_tokens(tokens, block_size, lora)) for tokens, lora in queries]
    return hashes, body.get("window_size"), "prompts" in body


def _plain_integers(text: bytes) -> bool:
    """No character outside digits, ``[``, ``]``, ``,`` and JSON whitespace, and no leading zero."""
    if text.strip(b"0123456789[], \t\r\n"):
        return False
    words = text.replace(b"[", b" ").replace(b"]", b" ").replace(b",", b" ").split()
    return all(len(w) == 1 or not w.startswith(b"0") for w in words)


class AnswerTable:
    """Everything a ``/match`` answer needs about the index's workers, by worker number (the
    position of its key in sorted order): which worker each cache slot belongs to, each
    worker's JSON pieces (``heads``: the start of a score entry up to ``"matched_blocks":``;
    ``lefts``: the same for a left-out entry, with its state, or None for a routable worker),
    and whether it is degraded."""

    def __init__(
        self,
        slot_worker: Sequence[int],
        heads: list[bytes],
        lefts: list[bytes | None],
        degraded: Sequence[bool],
    ) -> None:
        nw = len(heads)
        if len(lefts) != nw or len(degraded) != nw:
            raise ValueError("heads, lefts and degraded must have one entry per worker")
        for i, w in enumerate(slot_worker):
            if not 0 <= w < nw:
                raise ValueError(f"slot {i} names worker {w} of {nw}")
        self._slot_worker = list(slot_worker)
        self._heads = heads
        self._lefts = lefts
        self._degraded = [bool(d) for d in degraded]

    @property
    def slots(self) -> int:
        return len(self._slot_worker)

    def render(self, matches: list[tuple[int, int, int]], blocks: int, weight: float) -> bytes | None:
        """The JSON answer to one query from the index core's ``match`` (``(slot, run, primary)``
        per slot), or None when a slot is newer than this table (build a new one)."""
        best: dict[int, tuple[int, int]] = {}
        for slot, run, prim in matches:
            if slot >= len(self._slot_worker):
                return None
            w = self._slot_worker[slot]
            old = best.get(w)
            if old is None or (run, prim) > old:
                best[w] = (run, prim)
        ranked: list[tuple[float, int, int, int]] = []
        left: list[tuple[int, int]] = []
        for w, (run, prim) in best.items():
            if run <= 0:
                continue
            if self._lefts[w] is not None:
                left.append((w, run))
                continue
            score = float(run) if weight == 1.0 else round(prim + weight * (run - prim), 6)
            ranked.append((-score, -run, w, prim))
        ranked.sort()
        left.sort()
        entries = [
            b"%s%d,\"primary_blocks\":%d,\"score\":%s,\"degraded\":%s}"
            % (self._heads[w], -negative_run, prim, repr(-negative_score).encode(),
               b"true" if self._degraded[w] else b"false")
            for negative_score, negative_run, w, prim in ranked
        ]  # fmt: skip
        lefts = [b"%s%d}" % (self._lefts[w] or b"", run) for w, run in left]
        return b'{"blocks":%d,"scores":[%s],"best":%s,"left_out":[%s]}' % (
            blocks,
            b",".join(entries),
            entries[0] if entries else b"null",
            b",".join(lefts),
        )
