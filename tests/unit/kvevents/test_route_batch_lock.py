"""``route --serve`` holds the index lock in short pieces, so ingest (and other requests) run
in between: a batch is answered one prompt per hold (a batch of 256 prompts against 4,000
workers renders 115 MB, 0.4 s that once held the lock whole), on every body form (the plain
one, the fast-decoded one, the general one and ``/match/hashes``); GET /workers builds its rows
256 per hold (348 ms for 32,768 workers in one hold before)."""

from __future__ import annotations

import json
import threading
from typing import Any

import pytest
from kvevents.consumer import CacheIndex
from test_route_http import BS, PROMPT, store_prefix

from kvevents.commands._route_app import AppOptions, RouteApp, StaticSource


class IngestBetweenHolds:
    """A lock that, each time it is released, lets "ingest" store one more worker's prefix."""

    def __init__(self, index: CacheIndex) -> None:
        self._lock = threading.Lock()
        self.index = index
        self.holds = 0

    def __enter__(self) -> None:
        self._lock.acquire()
        self.holds += 1

    def __exit__(self, *exc: Any) -> None:
        self._lock.release()
        store_prefix(self.index, f"late{self.holds}", PROMPT, 4)  # between two holds


BODIES = {
    "plain": ("/match", {"prompts": [{"token_ids": PROMPT}] * 3}),
    "fast": ("/match", {"prompts": [{"token_ids": PROMPT}] * 3, "secondary_weight": 0.5}),
    "general": ("/match", {"prompts": [{"token_ids": [*PROMPT, 2**31 + 5]}] * 3, "window_size": 64}),
    "hashes": ("/match/hashes", {"prompts": [{"block_hashes": [hash(("a", 0)) & 0xFFFFFFFF]}] * 3}),
}


@pytest.mark.parametrize("form", list(BODIES))
def test_each_prompt_of_a_batch_holds_the_lock_on_its_own(form: str) -> None:
    index = CacheIndex()
    store_prefix(index, "a", PROMPT, 4)
    source = StaticSource(index)
    lock = IngestBetweenHolds(index)
    source.lock = lock  # type: ignore[assignment]
    app = RouteApp(source, AppOptions(block_size=BS))
    path, body = BODIES[form]
    status, _, out = app.answer_post(path, json.dumps(body).encode())
    assert status == 200, out
    results = json.loads(out)["results"]
    assert lock.holds == 3
    seen = [sorted(s["instance_id"] for s in r["scores"]) for r in results]
    if form == "hashes":  # engine hashes: only "a" stored that one
        assert seen == [["a"]] * 3
    else:  # each prompt sees the workers stored between the holds before it
        assert seen == [["a"], ["a", "late1"], ["a", "late1", "late2"]]


def test_the_workers_view_is_built_a_few_hundred_rows_per_hold() -> None:
    """GET /workers lists every worker, its rows built 256 per hold of the lock (ingest runs
    in between; a worker that arrives meanwhile is in the next answer)."""
    index = CacheIndex()
    for k in range(600):
        store_prefix(index, f"w{k:03d}", PROMPT, 1)
    source = StaticSource(index)
    lock = IngestBetweenHolds(index)
    source.lock = lock  # type: ignore[assignment]
    answer = json.loads(RouteApp(source, AppOptions(block_size=BS))._workers())
    assert lock.holds == 1 + 3  # the keys and summary, then 256 + 256 + 88 rows
    assert [r["instance_id"] for r in answer["workers"]] == [f"w{k:03d}" for k in range(600)]
    assert answer["summary"]["workers"] == 600 and answer["summary"]["live_workers"] == 600
