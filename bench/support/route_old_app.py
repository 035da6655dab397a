"""The handlers ``route --serve`` had before its fast path (the baseline of
``bench/route_serve.py``): msgspec decodes every token id into a Python int, the index hashes
the list, ``CacheIndex.match_details`` as it was (a ``WorkerKey`` built per cache slot), and
``score_query``'s dicts encoded by msgspec. The answers are the same bytes."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec
from kvevents.consumer import CacheIndex, WorkerKey
from kvevents.consumer.index import Match, _max_level

from kvevents.commands._route_app import AppOptions, HttpError, IndexSource, RouteApp, StaticSource
from kvevents.commands._route_requests import HASH_MAX, HashesBody, score_query


class OldIndex:
    """``index`` with ``match_details`` as it was: one ``slot_key`` call and ``WorkerKey`` per slot."""

    def __init__(self, index: CacheIndex) -> None:
        self._index = index

    def __getattr__(self, name: str) -> Any:
        return getattr(self._index, name)

    def match_details(
        self, hashes: Sequence[int], *, by_content: bool = False, window_size: int | None = None,
        max_cache_level: int | None = None,
    ) -> dict[WorkerKey, Match]:  # fmt: skip
        core = self._index._core
        best: dict[WorkerKey, Match] = {}
        for slot, run, primary in core.match(hashes, by_content, window_size, _max_level(max_cache_level)):
            instance_id, rank, _ = core.slot_key(slot)
            key = WorkerKey(instance_id, rank)
            match = Match(run, primary)
            if key not in best or match > best[key]:
                best[key] = match
        return best


class OldRouteApp(RouteApp):
    """:class:`RouteApp` answering ``/match`` and ``/match/hashes`` the old way."""

    def __init__(self, source: IndexSource, options: AppOptions | None = None) -> None:
        super().__init__(StaticSource(OldIndex(source.index)), options)  # type: ignore[arg-type]

    def _match_tokens(self, raw: bytes) -> bytes:
        return self._match_tokens_general(raw)

    def _match_hashes(self, raw: bytes) -> bytes:
        try:
            body = msgspec.json.decode(raw, type=HashesBody)
        except msgspec.DecodeError as exc:
            raise HttpError(400, f"bad /match/hashes body: {exc}") from None
        queries = [body.block_hashes] if body.block_hashes is not None else [p.block_hashes for p in body.prompts or ()]  # fmt: skip
        if any(h and max(h) > HASH_MAX for h in queries):
            raise HttpError(400, "bad /match/hashes body: a hash of more than 64 bits")
        index = self.source.index
        with self.source.lock:
            left_out, degraded = self._exclusions_now()
            answers = [
                score_query(index, hashes, by_content=False, secondary_weight=body.secondary_weight,
                            window_size=body.window_size, left_out=left_out, degraded=degraded)
                for hashes in queries
            ]  # fmt: skip
        return msgspec.json.encode(answers[0] if body.block_hashes is not None else {"results": answers})
