"""Fixtures for the index tests: every test runs on both cores, and through both entry points."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from kvevents.consumer.index import CacheIndex, compiled_core_available
from kvevents.schemas import EventBatch, encode_batch

CORES = ["python", "compiled"]


@pytest.fixture(params=CORES)
def core(request: pytest.FixtureRequest) -> str:
    """The index core under test; a missing compiled core is a failure, not a skip."""
    if request.param == "compiled" and not compiled_core_available():
        pytest.fail("kvevents.consumer._indexcore is not built: pip install -e . (needs Cython and gcc)")
    return request.param


@pytest.fixture(params=["object", "bytes"])
def feed(request: pytest.FixtureRequest) -> Callable[[CacheIndex, EventBatch], None]:
    """Applies a batch as model objects, or as real encoded Avro bytes."""
    if request.param == "object":
        return lambda index, batch: index.apply(batch)
    return lambda index, batch: index.apply_encoded(encode_batch(batch))


@pytest.fixture
def index(core: str) -> CacheIndex:
    """An empty index on the core under test."""
    return CacheIndex(core=core)
