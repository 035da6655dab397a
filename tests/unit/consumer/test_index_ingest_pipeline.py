"""apply_encoded_many's two-thread path (compiled core): a native thread decodes the next batches
while the writer applies, and the result must be exactly what applying them one by one gives,
with the pure-Python core as the oracle: the same order, the same batches raising (a malformed
or over-the-limits batch in the middle of many), the same state and counters, and lookups
served while it runs."""

from __future__ import annotations

import re
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from _index_helpers import batch, shared_prefix_batches, stored
from _index_model import TroubledProducer
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kvevents.consumer import _indexcore
from kvevents.consumer.index import CacheIndex
from kvevents.schemas import BatchLimits, DecodeError, LimitError, encode_batch
from test_differential import mutate


@pytest.fixture(autouse=True)
def two_threads() -> Iterator[None]:
    """The two-thread path (``KVEVENTS_INGEST_THREADS=2``; the default is one thread)."""
    old = _indexcore._set_ingest_threads(2)
    yield
    _indexcore._set_ingest_threads(old)


@contextmanager
def decoder_stalled(seconds: float) -> Iterator[None]:
    """The decoding thread sleeps ``seconds`` before each batch (as when starved of CPU)."""
    old = _indexcore._set_decoder_stall(seconds)
    try:
        yield
    finally:
        _indexcore._set_decoder_stall(old)


NOTE = re.compile(r"apply_encoded_many: batch (\d+) \(the \1 before it are applied\)")


def feed_many(index: CacheIndex, messages: list[bytes]) -> list[int]:
    """Every message through apply_encoded_many, resuming after each one that raises (as a
    reader would); the positions that raised."""
    failed: list[int] = []
    start = 0
    while start < len(messages):
        try:
            assert index.apply_encoded_many(messages[start:]) == len(messages) - start
            break
        except DecodeError as exc:
            notes = [m for m in map(NOTE.fullmatch, exc.__notes__) if m]
            assert len(notes) == 1, exc.__notes__
            failed.append(start + int(notes[0].group(1)))
            start = failed[-1] + 1
    return failed


def feed_one_by_one(index: CacheIndex, messages: list[bytes]) -> list[int]:
    failed = []
    for i, message in enumerate(messages):
        try:
            index.apply_encoded(message)
        except DecodeError:
            failed.append(i)
    return failed


def troubled_messages(data: st.DataObject) -> list[bytes]:
    producer = TroubledProducer(data.draw, st)
    for _ in range(data.draw(st.integers(5, 50), label="steps")):
        producer.step()
    for name, inst in producer.instances.items():
        producer.flush(inst, name)
    out = []
    for message in (encode_batch(b) for b in producer.delivered):
        if data.draw(st.integers(0, 4), label="damage") == 0:
            out.append(mutate(message, data.draw))
        out.append(message)
    return out


@settings(
    max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large]
)
@given(st.data())
def test_the_pipeline_applies_like_one_by_one_on_the_oracle(data: st.DataObject) -> None:
    """Troubled streams (drops, splits, replays, lost batches, restarts) with damaged copies in
    between: the same batches raise, and both cores end in the same state and counters."""
    limits = BatchLimits(max_blocks_per_event=data.draw(st.sampled_from([4, 64]), label="max blocks"))
    messages = troubled_messages(data)
    piped = CacheIndex(core="compiled", limits=limits)
    oracle = CacheIndex(core="python", limits=limits)
    one_by_one = CacheIndex(core="compiled", limits=limits)
    # a stalled decoder makes the writer read some batches itself, the others from the stages
    with decoder_stalled(data.draw(st.sampled_from([0.0, 0.0002]), label="decoder stall")):
        failed = feed_many(piped, messages)
    assert failed == feed_one_by_one(oracle, messages)
    feed_one_by_one(one_by_one, messages)
    assert piped.to_bytes() == oracle.to_bytes() == one_by_one.to_bytes()
    assert piped.stats().counters == oracle.stats().counters == one_by_one.stats().counters


@pytest.mark.parametrize("core", ["compiled", "python"])
@pytest.mark.parametrize("bad", ["truncated", "over the limits", "not bytes", "not single-object"])
def test_a_bad_batch_in_the_middle_of_many_stops_there(core: str, bad: str) -> None:
    good = shared_prefix_batches(40)
    limits = BatchLimits(max_blocks_per_event=40)  # the stream's events have 40 blocks
    broken: object
    if bad == "truncated":
        broken = good[21][:-5]
    elif bad == "over the limits":
        broken = encode_batch(batch([stored(10**5, list(range(100, 141)))], 10**4, dp=8))
    elif bad == "not bytes":
        broken = "a string"
    else:
        broken = b"\x00" + good[21][1:]
    index = CacheIndex(core=core, limits=limits)
    with pytest.raises(LimitError if bad == "over the limits" else DecodeError) as info:
        index.apply_encoded_many([*good[:21], broken, *good[21:]])  # type: ignore[list-item]
    assert any("batch 21 (the 21 before it are applied)" in n for n in info.value.__notes__)
    before = CacheIndex(core="python", limits=limits)
    for body in good[:21]:
        before.apply_encoded(body)
    assert index.to_bytes() == before.to_bytes()  # the batches before it, and none after
    assert index.stats().counters == before.stats().counters
    assert index.apply_encoded_many(good[21:]) == len(good) - 21  # the caller resumes after it
    whole = CacheIndex(core="python", limits=limits)
    whole.apply_encoded_many(good)
    assert index.to_bytes() == whole.to_bytes()


def test_lookups_are_served_during_one_pipelined_call() -> None:
    """A reader thread's lookups run while apply_encoded_many applies 250 batches, and each
    answer is the index between two events (a rank's run over the prefix is 0, 32 or 40)."""
    data = shared_prefix_batches(250)
    index = CacheIndex(core="compiled")
    started, done = threading.Event(), threading.Event()
    seen: list[dict[Any, int]] = []
    errors: list[Exception] = []

    def reader() -> None:
        query = list(range(1, 33)) + [10**6 + 1000 + j for j in range(8)]
        started.set()
        try:
            while not done.is_set():
                seen.append(index.find_matches(query))
        except Exception as exc:  # noqa: BLE001 - the assert below reports it
            errors.append(exc)

    thread = threading.Thread(target=reader)
    thread.start()
    started.wait()
    try:
        assert index.apply_encoded_many(data) == len(data)
    finally:
        done.set()
        thread.join()
    assert not errors
    alone = CacheIndex(core="compiled")
    for body in data:
        alone.apply_encoded(body)  # one by one (the oracle's agreement is tested above)
    assert index.to_bytes() == alone.to_bytes()
    assert len(seen) > 10
    assert any(len(answer) < 8 for answer in seen)  # some answers came before the end
    for answer in seen:
        assert all(v in (32, 40) for v in answer.values()), answer


@pytest.mark.parametrize("stall", [0.0, 0.003])
def test_the_writer_reads_batches_the_decoder_is_late_with(stall: float) -> None:
    """Every batch is taken exactly once, from the decoder's stage or read by the writer, and
    the index is the one the batches make one by one. With the decoder stalled 3 ms per batch
    the writer reads batches itself, both ways: claiming ones the decoder has not started, and
    re-reading one the decoder holds once its patience is out. (Which batches go which way
    depends on the scheduler: a busy machine may not run the decoder at all in one call, so the
    calls repeat, at most 20 times, until both ways are seen.)"""
    data = shared_prefix_batches(60)
    alone = CacheIndex(core="compiled")
    for body in data:
        alone.apply_encoded(body)
    seen = {"stolen": 0, "duplicated": 0}
    for _ in range(20 if stall else 1):
        index = CacheIndex(core="compiled")
        with decoder_stalled(stall):
            assert index.apply_encoded_many(data) == len(data)
        counts = index._core.pipeline_counts()  # type: ignore[attr-defined]
        assert sum(counts.values()) == len(data), counts
        assert index.to_bytes() == alone.to_bytes()
        assert index.stats().counters == alone.stats().counters
        seen = {k: seen[k] + counts[k] for k in seen}
        if all(seen.values()):
            break
    if stall:
        assert all(seen.values()), seen
