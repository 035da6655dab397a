"""A query's hashes must be 64-bit ints: both cores raise the same named error for the first
key their walk reaches that is not one, and neither reads the keys after a query stops
matching (the compiled core converts a list's keys lazily, a few groups ahead)."""

from __future__ import annotations

from array import array
from collections.abc import Callable, Sequence

import pytest
from _index_helpers import W0, batch, created, stored, tokens_for
from kvevents.consumer import CacheIndex

CHAIN = list(range(1, 81))  # 80 blocks: five of the compiled walk's 16-key groups


@pytest.fixture
def held(index: CacheIndex) -> CacheIndex:
    index.apply(batch([created(0), stored(1, CHAIN)], 0))
    return index


def _contents(index: CacheIndex) -> list[int]:
    return index.content_hashes(tokens_for(CHAIN), 4)


@pytest.mark.parametrize("at", [0, 1, 15, 16, 17, 31, 32, 47, 48, 79])
@pytest.mark.parametrize("bad", [-1, 1 << 64, -(1 << 63)])
@pytest.mark.parametrize("shape", [list, tuple])
def test_an_out_of_range_hash_the_walk_reaches_is_a_value_error_naming_it(
    held: CacheIndex, at: int, bad: int, shape: Callable[[list[int]], Sequence[int]]
) -> None:
    for query, find in [
        (list(CHAIN), held.find_matches),
        (_contents(held), held.find_matches_by_content),
    ]:
        query[at] = bad
        with pytest.raises(ValueError, match=rf"query hash #{at} must be within 0\.\.2\*\*64-1, got {bad}"):
            find(shape(query))


@pytest.mark.parametrize("bad", ["7", 7.0, None, b"\x07"])
def test_a_key_that_is_not_an_int_is_a_type_error_naming_it(held: CacheIndex, bad: object) -> None:
    query: list[object] = [*CHAIN[:20], bad, *CHAIN[21:]]
    with pytest.raises(TypeError, match=r"query hash #20 must be an int, got "):
        held.find_matches(query)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"query hash #20 must be an int"):
        held.match_details(query)  # type: ignore[arg-type]


@pytest.mark.parametrize("stop", [0, 3, 16, 40])
@pytest.mark.parametrize("gap", [1, 2, 17, 40])
def test_keys_after_the_query_stops_matching_are_not_read(held: CacheIndex, stop: int, gap: int) -> None:
    """A key no worker holds ends the walk; bad keys after it change nothing."""
    query: list[object] = [*CHAIN[:stop], 10_000, *CHAIN[stop + 1 : stop + gap], -1, "x", 1 << 70]
    expected = {W0: stop} if stop else {}
    assert held.find_matches(query) == expected  # type: ignore[arg-type]
    assert held.find_matches(tuple(query)) == expected  # type: ignore[arg-type]
    assert {k: m.blocks for k, m in held.match_details(query).items()} == expected  # type: ignore[arg-type]
    contents: list[object] = list(_contents(held))
    contents[stop] = 10_000
    contents[stop + gap :] = [-1, "x"]
    assert held.find_matches_by_content(contents) == expected  # type: ignore[arg-type]


def test_an_empty_index_reads_only_the_first_key(index: CacheIndex) -> None:
    assert index.find_matches([5, -1]) == {}
    with pytest.raises(ValueError, match="#0"):
        index.find_matches([-1, 5])


def test_other_int_types_are_read_as_their_value(held: CacheIndex) -> None:
    """Ints with ``__index__`` (a bool, an int subclass) and an ``array('Q')`` are hashes."""

    class Hash(int):
        pass

    assert held.find_matches([Hash(h) for h in CHAIN[:10]]) == {W0: 10}
    assert held.find_matches([True, 2, 3]) == {W0: 3}
    assert held.find_matches(array("Q", CHAIN)) == {W0: 80}
