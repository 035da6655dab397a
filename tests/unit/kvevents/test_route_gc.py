"""``route --serve``'s garbage-collector handling: the heap settled (collected and frozen) once the
index is loaded, and every collection counted and timed by generation for ``/metrics``."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest

from kvevents.commands._route_gc import GcPauses, settle


@pytest.fixture
def unfrozen() -> Iterator[None]:
    gc.unfreeze()
    yield
    gc.unfreeze()  # the rest of the test session collects as before


def test_settle_freezes_what_is_alive_and_later_collections_skip_it(unfrozen: None) -> None:
    kept = [[i] for i in range(5_000)]  # containers, tracked by the collector
    frozen = settle()
    assert frozen == gc.get_freeze_count() >= len(kept)
    pauses = GcPauses().install()
    try:
        gc.collect()
    finally:
        pauses.remove()
    assert pauses.count[2] == 1 and gc.get_freeze_count() == frozen  # still frozen after a full collection
    in_gen2 = {id(x) for x in gc.get_objects(2)}
    assert not any(id(x) in in_gen2 for x in kept)  # the permanent generation is not collected


def test_pauses_are_counted_and_timed_by_generation() -> None:
    pauses = GcPauses().install()
    try:
        gc.collect(0)
        gc.collect(0)
        gc.collect(1)
    finally:
        pauses.remove()
    assert pauses not in gc.callbacks
    assert pauses.count[0] >= 2 and pauses.count[1] >= 1  # automatic ones may add to them
    assert all(s > 0 for s in pauses.seconds[:2])
    assert all(0 < m <= s for m, s in zip(pauses.max_seconds[:2], pauses.seconds[:2], strict=True))
    before = list(pauses.count)
    gc.collect()
    assert pauses.count == before  # removed: no longer called


def test_install_twice_hooks_once() -> None:
    pauses = GcPauses()
    try:
        pauses.install().install()
        assert gc.callbacks.count(pauses) == 1
    finally:
        pauses.remove()
