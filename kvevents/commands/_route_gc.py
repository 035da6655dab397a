"""The garbage collector in a ``route --serve`` process: the heap settled once the index is
loaded (:func:`settle`: collected, then frozen, so no later full collection walks the objects the
process started with), and each collection's pause timed (:class:`GcPauses`) for ``/metrics``.
Why and what was measured: docs/ROUTER.md ("Where the half-load tail comes from")."""

from __future__ import annotations

import gc
import time
from typing import Any

__all__ = ["GcPauses", "settle"]


def settle() -> int:
    """Collect, then move every object left into the permanent generation (``gc.freeze``); the
    number of objects frozen. Called before the worker processes are forked (their collections
    then leave the parent's objects, and the pages holding them, alone) and in each serving
    process once its index source is made."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


class GcPauses:
    """Count and time every collection of this process, by generation (a ``gc.callbacks`` hook:
    two calls and a clock read per collection, a few per thousand requests)."""

    def __init__(self) -> None:
        self.count = [0, 0, 0]
        self.seconds = [0.0, 0.0, 0.0]
        self.max_seconds = [0.0, 0.0, 0.0]
        self._started = 0.0

    def __call__(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
            return
        took = time.perf_counter() - self._started
        generation = info["generation"]
        self.count[generation] += 1
        self.seconds[generation] += took
        if took > self.max_seconds[generation]:
            self.max_seconds[generation] = took

    def install(self) -> GcPauses:
        if self not in gc.callbacks:
            gc.callbacks.append(self)
        return self

    def remove(self) -> None:
        if self in gc.callbacks:
            gc.callbacks.remove(self)
