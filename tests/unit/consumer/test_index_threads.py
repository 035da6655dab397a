"""Threads: lookups from other threads while one thread applies batches (compiled core).

The compiled core applies a batch's events without the GIL, holding its index lock, and hands
the lock to a waiting reader between two events, so a reader thread's lookups run while a long
batch is applied; they see the index between two events. Inside a worker's restart too, its
caches hidden from queries meanwhile. One writer at a time: a second
mutation while a batch is being applied raises RuntimeError.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Iterator
from typing import Any, ClassVar

import pytest
from _index_helpers import batch, created, shared_prefix_batches, stored
from kvevents.consumer._indexcore import IndexCore
from kvevents.consumer._state import encode_state
from kvevents.consumer.index import CacheIndex


@pytest.fixture
def fast_switching() -> Iterator[None]:
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    yield
    sys.setswitchinterval(old)


def test_lookups_run_during_ingest_and_see_whole_events(fast_switching: None) -> None:
    data = shared_prefix_batches(150)
    index = CacheIndex(core="compiled")
    done = threading.Event()
    seen: list[dict[object, int]] = []
    errors: list[Exception] = []

    def reader() -> None:
        query = list(range(1, 33)) + [10**6 + 1000 + j for j in range(8)]
        try:
            while not done.is_set():
                seen.append(index.find_matches(query))
                index.find_matches_for_tokens(list(range(64)), 4)
        except Exception as exc:  # noqa: BLE001 - the assert below reports it
            errors.append(exc)

    thread = threading.Thread(target=reader)
    thread.start()
    try:
        for body in data:
            index.apply_encoded(body)
    finally:
        done.set()
        thread.join()
    assert not errors
    alone = CacheIndex(core="compiled")
    for body in data:
        alone.apply_encoded(body)
    assert index.same_state(alone)  # a reader (its own scratch) never disturbs the writer
    # whole events only: a worker's run over the shared prefix is 0 or all 32 (+ its tail)
    assert len(seen) > 10
    for answer in seen:
        assert all(v in (32, 40) for v in answer.values()), answer


def test_lookups_are_served_inside_one_long_call_at_the_default_switch_interval() -> None:
    """No switch-interval tuning: lookups are answered while one apply_encoded_many call runs
    (before, a reader woken every time the writer yielded the GIL went back to waiting a whole
    interval, and got the GIL mostly when the call returned)."""
    data = shared_prefix_batches(200)
    index = CacheIndex(core="compiled")
    index.apply_encoded(data[0])
    started, done = threading.Event(), threading.Event()
    during: list[dict[object, int]] = []
    query = list(range(1, 33))

    def reader() -> None:
        started.set()
        while not done.is_set():
            answer = index.find_matches(query)
            if not done.is_set():
                during.append(answer)

    thread = threading.Thread(target=reader)
    thread.start()
    started.wait()
    try:
        assert index.apply_encoded_many(data[1:]) == len(data) - 1
    finally:
        done.set()
        thread.join()
    # the writer hands its lock to a waiting reader at every event: far more than one lookup
    # per batch (a reader that waited for the GIL got one in about 5 batches here)
    assert len(during) >= len(data), len(during)
    assert all(set(a.values()) <= {32} for a in during)
    assert len(index.find_matches(query)) == 8


def test_a_second_writer_while_a_batch_is_applied_is_refused() -> None:
    core: IndexCore
    refused: list[str] = []

    def key(instance_id: str, rank: int) -> tuple[str, int]:
        # called while the batch that introduces the worker is being applied
        for call in (
            lambda: core.apply_batch(batch([created(0)], 0, "other")),
            lambda: core.reset_worker("i0", 0, True),
            lambda: core.mark_degraded("i0", 0, "x"),
        ):
            with pytest.raises(RuntimeError, match="one writer at a time") as info:
                call()
            refused.append(str(info.value))
        return (instance_id, rank)

    core = IndexCore(key)
    core.apply_batch(batch([created(0), stored(1, [1, 2, 3])], 0))
    assert len(refused) == 3
    assert core.match_counts([1, 2, 3], False, None, 15) == {("i0", 0): 3}
    core.apply_batch(batch([stored(2, [4], parent=3)], 1))  # the writer flag was cleared


def test_an_event_that_raises_leaves_the_index_lock_free() -> None:
    """An exception inside the locked event loop (here: an unhashable worker key, hashed when
    the window cache is created) propagates and the next queries still run."""
    core = IndexCore(lambda instance_id, rank: [instance_id, rank])
    with pytest.raises(TypeError):
        core.apply_batch(batch([created(0), stored(1, [1, 2])], 0))
    answers: list[object] = []
    thread = threading.Thread(target=lambda: answers.append(core.match([1, 2], False, None, 15)))
    thread.start()
    thread.join(timeout=10)
    assert not thread.is_alive(), "the query waits for an index lock nobody holds"
    assert answers == [[]]


class _QueryingKey(tuple[str, int]):
    """A worker key whose hash (taken while the batch that creates its window cache is applied,
    the index lock held by the applying thread) makes a query on the same index."""

    core: ClassVar[IndexCore | None] = None
    answers: ClassVar[list[object]] = []

    def __hash__(self) -> int:
        if _QueryingKey.core is not None:
            _QueryingKey.answers.append(_QueryingKey.core.match_counts([1, 2], False, None, 15))
        return tuple.__hash__(self)


def test_a_query_from_a_callback_of_the_applying_thread_does_not_deadlock() -> None:
    """The writer holds the index lock while it applies events; a query made by that same thread
    (a key's hash, a log handler) runs without waiting for itself, and sees the events before."""
    core = IndexCore(lambda instance_id, rank: _QueryingKey((instance_id, rank)))
    core.apply_batch(batch([created(0), stored(1, [1, 2])], 0))
    _QueryingKey.core, _QueryingKey.answers = core, []
    done: list[object] = []

    def apply() -> None:  # a new worker: its window cache is created (and its key hashed) mid-batch
        core.apply_batch(batch([created(0), stored(1, [1])], 0, "i1"))
        done.append(core.match_counts([1, 2], False, None, 15))

    thread = threading.Thread(target=apply, daemon=True)
    thread.start()
    thread.join(timeout=10)
    _QueryingKey.core = None
    assert not thread.is_alive(), "a query from the applying thread's callback deadlocked"
    assert _QueryingKey.answers == [{("i0", 0): 2}]
    assert done == [{("i0", 0): 2, ("i1", 0): 1}]
    # the lock was given back: another thread's query runs
    other = threading.Thread(target=lambda: done.append(core.match([1], False, None, 15)), daemon=True)
    other.start()
    other.join(timeout=10)
    assert not other.is_alive() and len(done) == 2


def test_a_query_from_inside_a_query_of_the_same_thread_raises() -> None:
    core = IndexCore(lambda instance_id, rank: (instance_id, rank))
    core.apply_batch(batch([created(0), stored(1, [1, 2])], 0))

    class Reentrant:
        def __int__(self) -> int:
            core.match_counts([1], False, None, 15)
            return 2

        __index__ = __int__

    with pytest.raises(RuntimeError, match="from inside a query"):
        query: list[Any] = [1, Reentrant()]
        core.match_counts(query, False, None, 15)
    assert core.match_counts([1, 2], False, None, 15) == {("i0", 0): 2}


def _big_index(blocks: int) -> CacheIndex:
    """One worker holding ``blocks`` blocks (events of 1,000), for exports that take a while."""
    from kvevents.schemas import encode_batch

    index = CacheIndex(core="compiled")
    per = 1000
    events = [stored(1 + k, list(range(k * per + 1, (k + 1) * per + 1))) for k in range(blocks // per)]
    index.apply_encoded_many([encode_batch(batch(events[i : i + 20], i)) for i in range(0, len(events), 20)])
    return index


def test_queries_run_while_the_state_is_exported() -> None:
    """export_state (to_bytes, checkpoints) reads the index without its lock when no writer
    call is in progress, so another thread's lookups go on during it: no gap between two
    answers lasts half the export (with the lock held throughout, one gap was the whole
    export). The state is the one a locked export gives."""
    index = _big_index(400_000)
    core: Any = index._core
    locked = index.to_bytes()
    ends: list[float] = []
    done = threading.Event()

    def reader() -> None:
        while not done.is_set():
            assert index.find_matches([1, 2, 3]) == {("i0", 0): 3}
            ends.append(time.perf_counter())

    thread = threading.Thread(target=reader)
    thread.start()
    verdicts = []
    try:
        for _ in range(5):  # the scheduler may keep the reader off a core for one export
            start = time.perf_counter()
            state = core.export_state()
            end = time.perf_counter()
            seen = [t for t in list(ends) if t > start]
            gaps = [b - a for a, b in zip([start, *seen], seen, strict=False) if a < end]
            verdicts.append((end - start, max(gaps, default=end - start)))
            if verdicts[-1][1] < verdicts[-1][0] / 2:
                break
    finally:
        done.set()
        thread.join()
    took, gap = verdicts[-1]
    assert gap < took / 2, verdicts
    assert encode_state(state) == locked


def test_a_writer_waits_for_an_export_instead_of_failing() -> None:
    """Batches applied from one thread while another exports the state again and again: no
    writer call is refused, and each export is a whole state (it loads, holding the blocks of
    a whole number of batches)."""
    index = _big_index(200_000)
    core: Any = index._core
    extra = [
        batch([stored(10_000 + k, [10**7 + k * 10 + j for j in range(10)])], 1000 + k) for k in range(40)
    ]
    from kvevents.schemas import encode_batch

    errors: list[BaseException] = []

    def writer() -> None:
        try:
            for b in extra:
                index.apply_encoded(encode_batch(b))
        except BaseException as exc:  # noqa: BLE001 - the assert below reports it
            errors.append(exc)

    thread = threading.Thread(target=writer)
    thread.start()
    exports = []
    while thread.is_alive():
        exports.append(core.export_state())
    thread.join()
    assert not errors, errors
    assert index.held_blocks() == 200_000 + 400
    for state in exports:
        held = CacheIndex.from_bytes(encode_state(state), core="compiled").held_blocks()
        assert held >= 200_000 and (held - 200_000) % 10 == 0, held


# A worker's restart (a Created event) drops all its blocks holding the index lock. The drop
# hands the lock to waiting readers every few dozen blocks, its worker's caches hidden from
# queries meanwhile; introspection waits for the whole drop.

RESTART_BLOCKS = 300_000
CHAIN = [10**7 + j for j in range(RESTART_BLOCKS)]
HALF = RESTART_BLOCKS // 2
ACROSS = CHAIN[HALF - 16 : HALF + 16]  # 16 blocks of each half


@pytest.fixture(scope="module", params=[0, 10], ids=["one window", "11 windows"])
def restart_stream(request: pytest.FixtureRequest) -> tuple[bytes, bytes]:
    """Rank 1 holds CHAIN, stored second half first (so its drop, in node order, empties the
    second half first: a query ACROSS the halves would see rank 1's run cut to 16); rank 0
    holds ACROSS too, stored after (its nodes are rank 1's). Rank 1 may also hold a block in
    each of ``request.param`` other window caches (a worker with more than 8 was dropped
    holding the lock). Then rank 1 restarts."""
    from kvevents.schemas import encode_batch

    step = 50_000  # blocks per Stored event (under BatchLimits.max_blocks_per_event)
    starts = [*range(HALF, RESTART_BLOCKS, step), *range(0, HALF, step)]
    rank1 = [
        stored(1 + i, CHAIN[at : at + step], parent=CHAIN[at - 1] if at else None, rank=1)
        for i, at in enumerate(starts)
    ]
    eid = 1 + len(starts)
    rank1 += [stored(eid + k, [5 * 10**8 + k], window=100 + k, rank=1) for k in range(request.param)]
    eid += request.param
    setup = batch([created(0, rank=1), *rank1, created(0, rank=0), stored(1, ACROSS, rank=0)], 0, dp=2)
    return encode_batch(setup), encode_batch(batch([created(eid, rank=1)], 1, dp=2))


@pytest.fixture
def restarting(restart_stream: tuple[bytes, bytes]) -> tuple[CacheIndex, bytes]:
    """A compiled index holding the stream's setup, and the restart batch to apply."""
    setup, restart = restart_stream
    index = CacheIndex(core="compiled")
    index.apply_encoded(setup)
    return index, restart


def _restart_while(index: CacheIndex, restart: bytes, look: Any) -> list[Any]:
    """Apply ``restart`` while another thread calls ``look`` back to back; its answers."""
    seen: list[Any] = []
    started, done = threading.Event(), threading.Event()

    def reader() -> None:
        started.set()
        while not done.is_set():
            seen.append(look())

    thread = threading.Thread(target=reader)
    thread.start()
    started.wait()
    try:
        index.apply_encoded(restart)
    finally:
        done.set()
        thread.join()
    return seen


def test_lookups_during_a_restart_see_the_worker_whole_or_gone(
    fast_switching: None, restarting: tuple[CacheIndex, bytes]
) -> None:
    index, restart = restarting
    before = {("i0", 0): 32, ("i0", 1): 32}
    assert index.find_matches(ACROSS) == before
    seen = _restart_while(index, restart, lambda: index.find_matches(ACROSS))
    assert index._core.store_layout()["drop_handovers"] > 0  # lookups were answered mid-drop
    assert index.find_matches(ACROSS) == {("i0", 0): 32}
    assert all(answer in (before, {("i0", 0): 32}) for answer in seen), {str(a) for a in seen}
    assert index.held_blocks() == 32


def test_introspection_during_a_restart_waits_for_the_whole_drop(
    fast_switching: None, restarting: tuple[CacheIndex, bytes]
) -> None:
    index, restart = restarting

    def rank1_blocks() -> int:
        return sum(w.blocks for w in index.worker_stats(("i0", 1)).windows.values())  # type: ignore[arg-type]

    whole = rank1_blocks()
    assert whole >= RESTART_BLOCKS
    seen = _restart_while(index, restart, rank1_blocks)
    assert index._core.store_layout()["drop_handovers"] > 0  # it asked for the lock mid-drop
    assert set(seen) <= {whole, 0}, sorted(set(seen))
    assert rank1_blocks() == 0
