"""kvevents._brief.brief: a value described in an error message, short whatever the value."""

from __future__ import annotations

import pytest
from deep_values import nested_list

from kvevents._brief import brief


class _ReprFails:
    def __repr__(self) -> str:
        raise RuntimeError("no")


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (7, "7"),
        (2**64, "18446744073709551616"),
        ("abc", "'abc'"),
        ([1, [2, [3, [4]]]], "[1, [2, [3, [...]]]]"),
        (list(range(10**6)), "[0, 1, 2, 3, 4, 5, ...]"),
        (nested_list(100_000), "[[[[...]]]]"),
        (10**5000, "<an int of 16610 bits>"),
    ],
    ids=["int", "u64+1", "str", "nested", "a million items", "nested 100k deep", "5,000 digits"],
)
def test_brief_is_repr_cut_short(value: object, expected: str) -> None:
    assert brief(value) == expected


def test_brief_of_long_strings_and_failing_reprs_stays_short() -> None:
    assert len(brief("x" * 10**6)) <= 80
    assert brief(_ReprFails()).startswith("<_ReprFails instance at")
