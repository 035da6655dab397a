"""Values nested past any decoder's or repr()'s depth, for the hostile-input tests."""

from __future__ import annotations

from typing import Any


def nested_list(depth: int) -> list[Any]:
    """``[[[...[]...]]]``, ``depth`` lists deep, built without recursion."""
    outer: list[Any] = []
    inner = outer
    for _ in range(depth):
        inner.append([])
        inner = inner[0]
    return outer
