"""The rule both index cores apply to a query's hashes, with one wording for its errors."""

from __future__ import annotations

import operator

from kvevents._brief import brief

U64_END = 1 << 64


def query_key(position: int, key: object) -> int:
    """``key`` as a 64-bit hash, or the error naming it: a ``TypeError`` for a value that is
    not an int, a ``ValueError`` for one outside 0..2**64-1 (a signed 64-bit hash must be
    given as its unsigned twin, as the index stores it). The cores check only the keys their
    walk reaches: the ones after a query stops matching are not read."""
    try:
        value = operator.index(key)  # type: ignore[arg-type]
    except TypeError:
        raise TypeError(f"query hash #{position} must be an int, got {brief(key)}") from None
    if not 0 <= value < U64_END:
        raise ValueError(f"query hash #{position} must be within 0..2**64-1, got {brief(value)}")
    return value
