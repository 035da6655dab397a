"""kvevents.consumer.export: the topic republished for routers that do not read Kafka.

:mod:`.zmq_export` publishes vLLM's ZMQ wire format (:mod:`.vllm_wire`, converted by
:mod:`.convert`) with replay from Kafka; :mod:`.dynamo_export` writes NVIDIA Dynamo RouterEvents.
Importing this package needs no ZMQ; the exporter imports pyzmq (the ``bridge`` extra) when built.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

__all__ = ["relaxed_gc"]


@contextlib.contextmanager
def relaxed_gc(threshold: int = 50_000) -> Iterator[None]:
    """Within the block, collect the youngest generation every ``threshold`` allocations instead
    of CPython's 700: exporting allocates many short-lived lists, and the default made the cyclic
    collector 10-20% of the exporter's CPU (``bench/export.py``). The old thresholds come back."""
    old = gc.get_threshold()
    gc.set_threshold(threshold, old[1], old[2])
    try:
        yield
    finally:
        gc.set_threshold(*old)
