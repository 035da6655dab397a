"""Bounded memory for analytics over long ranges: ``stats`` and ``report`` read a topic that
may hold billions of blocks, so what they keep per block is capped, and what the cap costs is
counted, never silent.

- :class:`Reservoir`: values kept exactly up to a capacity, then a uniform sample of them
  (count, sum and max stay exact);
- :class:`RecentMap`: a map keeping the most recently written keys, in two generations (a
  lookup finds a key written in the current or the previous one); older keys are forgotten
  and counted.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Generic, TypeVar

__all__ = ["RecentMap", "Reservoir"]

K = TypeVar("K")
V = TypeVar("V")


class Reservoir:
    """Every value up to ``capacity``, then a uniform sample of ``capacity`` of them
    (Vitter's algorithm R, seeded: the same stream gives the same sample)."""

    def __init__(self, capacity: int = 1_000_000, seed: int = 0) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be at least 1, got {capacity}")
        self.capacity = capacity
        self.count = 0
        self.total = 0.0
        self.max: float | None = None
        self._values: list[float] = []
        self._random = random.Random(seed)

    def add(self, value: float) -> None:
        self.count += 1
        self.total += value
        if self.max is None or value > self.max:
            self.max = value
        if len(self._values) < self.capacity:
            self._values.append(value)
            return
        slot = self._random.randrange(self.count)
        if slot < self.capacity:
            self._values[slot] = value

    @property
    def sampled(self) -> bool:
        """Whether the values kept are a sample (more were added than fit)."""
        return self.count > len(self._values)

    def __iter__(self) -> Iterator[float]:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)


class RecentMap(Generic[K, V]):
    """A dict of at most ``2 * generation`` keys: the current generation takes writes; when it
    holds ``generation`` keys it becomes the previous one and the previous one is forgotten
    (its keys not written since are counted in ``forgotten``)."""

    def __init__(self, generation: int = 2_000_000) -> None:
        if generation < 1:
            raise ValueError(f"generation must be at least 1, got {generation}")
        self.generation = generation
        self.forgotten = 0
        self._current: dict[K, V] = {}
        self._previous: dict[K, V] = {}

    def get(self, key: K, default: V | None = None) -> V | None:
        value = self._current.get(key, _MISSING)
        if value is _MISSING:
            value = self._previous.get(key, default)
        return value  # type: ignore[return-value]

    def __contains__(self, key: object) -> bool:
        return key in self._current or key in self._previous

    def __setitem__(self, key: K, value: V) -> None:
        current = self._current
        if key not in current and len(current) >= self.generation:
            self.forgotten += sum(1 for k in self._previous if k not in current)
            self._previous, current = current, {}
            self._current = current
        current[key] = value

    def __len__(self) -> int:
        return len(self._current) + sum(1 for k in self._previous if k not in self._current)


_MISSING: object = object()
