"""A short description of any value for an error message: bounded in length and nesting, and
never raising, because the value may come from a hostile payload (nested thousands deep, an int
of a million digits, a multi-megabyte list)."""

from __future__ import annotations

import reprlib
from typing import Any

_WIDEST_INT_BITS = 13_000  # about 3,900 digits: str() refuses past 4,300


class _Brief(reprlib.Repr):
    def __init__(self) -> None:
        super().__init__()
        self.maxlevel = 3
        self.maxstring = self.maxother = 80
        self.maxlong = 80
        self.maxlist = self.maxtuple = self.maxdict = self.maxset = self.maxfrozenset = 6

    def repr_int(self, x: int, level: int) -> str:
        if x.bit_length() > _WIDEST_INT_BITS:
            return f"<an int of {x.bit_length()} bits>"
        return super().repr_int(x, level)


_BRIEF = _Brief()


def brief(value: Any) -> str:
    """``repr(value)`` cut to about 80 characters and 3 levels of nesting."""
    try:
        return _BRIEF.repr(value)
    except Exception:  # noqa: BLE001 - a description must never be the error
        return f"<a {type(value).__name__}>"
