"""Property test: random enqueue/flush/get_events/drain sequences against a reference model.

``CppModel`` is a direct, single-threaded reading of the C++ manager (enqueue* L82-133, flush
L152-164, worker L233-269 including its truncation arithmetic, getEvents L135-150), building
the expected event objects itself. Hypothesis drives the real (threaded) manager and the model
with the same operations; after each ``flush`` the test waits for the worker (``settle``), so
every observation must agree exactly: events, ids, order, and drop counts.
"""

from __future__ import annotations

from collections import Counter

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from kvevents.producer import BlockInfo, KVCacheEventManager
from kvevents.producer._fastrecorder import Recorder
from kvevents.producer._recorder import PyRecorder
from kvevents.schemas import (
    KVCacheCreatedData,
    KVCacheEvent,
    KVCacheEventDiff,
    KVCacheRemovedData,
    KVCacheStoredBlockData,
    KVCacheStoredData,
    KVCacheUpdatedData,
    RankDrops,
)

WINDOWS = st.sampled_from([16, 32, 64])
HASHES = st.integers(0, (1 << 64) - 1)


class CppModel:
    """The C++ semantics, transliterated; no threads, no counters beyond what the test needs."""

    def __init__(self, max_entries: int, rank: int | None, size: int | None) -> None:
        self.max_size = max_entries * size if rank == 0 and size else max_entries
        self.rank = rank
        self.event_id = 0
        self.event_queue: list[KVCacheEvent] = []  # mEventQueue
        self.events: list[KVCacheEvent] = []  # mEvents
        self.dropped_by_window: Counter[int] = Counter()
        self.undrained_drops = 0

    def _enqueue(self, data: object, window: int) -> None:
        self.event_queue.append(KVCacheEvent(self.event_id, data, window, self.rank))  # type: ignore[arg-type]
        self.event_id += 1

    def created(self, levels: list[int], window: int) -> None:
        self._enqueue(KVCacheCreatedData(list(levels)), window)

    def stored(self, blocks: list[BlockInfo], window: int) -> None:
        if not blocks:
            return
        data = KVCacheStoredData(
            blocks[0].prev_block_hash,
            [
                KVCacheStoredBlockData(
                    b.block_hash,
                    list(b.tokens),
                    b.lora_id,
                    0 if b.is_primary else 1,
                    b.priority,
                    None if b.token_extra_ids is None else list(b.token_extra_ids),
                    b.mm_keys,
                    b.cache_salt,
                )
                for b in blocks
            ],
        )
        self._enqueue(data, window)

    def removed(self, block_hash: int, window: int) -> None:
        last = self.event_queue[-1] if self.event_queue else None
        if last is not None and last.window_size == window and isinstance(last.data, KVCacheRemovedData):
            merged = KVCacheRemovedData([*last.data.block_hashes, block_hash])
            self.event_queue[-1] = KVCacheEvent(last.event_id, merged, window, self.rank)
        else:
            self._enqueue(KVCacheRemovedData([block_hash]), window)

    def updated(self, data: KVCacheUpdatedData, window: int) -> None:
        self._enqueue(data, window)

    def flush(self) -> None:
        events, self.event_queue = self.event_queue, []
        if not events:
            return
        # worker(): elementsToRemove = mEvents.size() + events.size() - mMaxSize (signed here)
        elements_to_remove = len(self.events) + len(events) - self.max_size
        if elements_to_remove > 0:
            num_removed = min(len(self.events), elements_to_remove)
            self._drop(self.events[:num_removed])
            del self.events[:num_removed]
            elements_to_remove -= num_removed
        skip = max(0, elements_to_remove)
        self._drop(events[:skip])
        self.events.extend(events[skip:])

    def _drop(self, events: list[KVCacheEvent]) -> None:
        for event in events:
            self.dropped_by_window[event.window_size] += 1
        self.undrained_drops += len(events)

    def get_events(self) -> list[KVCacheEvent]:
        events, self.events = self.events, []
        return events

    def drain(self) -> tuple[list[KVCacheEvent], int]:
        drops, self.undrained_drops = self.undrained_drops, 0
        return self.get_events(), drops


blocks_strategy = st.lists(
    st.builds(
        BlockInfo,
        block_hash=HASHES,
        prev_block_hash=st.none() | HASHES,
        tokens=st.lists(st.integers(-(2**31), 2**31 - 1), max_size=4),
        lora_id=st.none() | HASHES,
        is_primary=st.booleans(),
        priority=st.integers(0, 100),
        cache_salt=st.none() | st.text(max_size=3),
    ),
    max_size=3,
)


class CompiledManager(KVCacheEventManager):
    """The manager on the compiled engine path (a failure, not a skip, when it is not built)."""

    _recorder_factory = Recorder


class PurePythonManager(KVCacheEventManager):
    """The manager on the pure-Python engine path (the fallback)."""

    _recorder_factory = PyRecorder


class ManagerAgainstModel(RuleBasedStateMachine):
    manager_class: type[KVCacheEventManager] = CompiledManager
    real: KVCacheEventManager
    model: CppModel

    @initialize(
        max_entries=st.integers(1, 6),
        dp=st.sampled_from([(None, None), (0, 2), (1, 3)]),
    )
    def start(self, max_entries: int, dp: tuple[int | None, int | None]) -> None:
        self.real = self.manager_class(
            max_entries, *dp, drop_warning_interval_s=3600, attention_dp_gather=False
        )
        self.model = CppModel(max_entries, *dp)
        self.rank_key = dp[0] or 0

    @rule(levels=st.lists(st.integers(0, 10_000), max_size=3), window=WINDOWS)
    def created(self, levels: list[int], window: int) -> None:
        self.real.enqueue_created_event(levels, window)
        self.model.created(levels, window)

    @rule(blocks=blocks_strategy, window=WINDOWS)
    def stored(self, blocks: list[BlockInfo], window: int) -> None:
        self.real.enqueue_stored_event(blocks, window)
        self.model.stored(blocks, window)

    @rule(block_hash=HASHES, window=WINDOWS)
    def removed(self, block_hash: int, window: int) -> None:
        self.real.enqueue_removed_event(block_hash, window)
        self.model.removed(block_hash, window)

    @rule(
        block_hash=HASHES,
        priority=st.none() | st.tuples(st.integers(0, 100), st.integers(0, 100)),
        window=WINDOWS,
    )
    def updated(self, block_hash: int, priority: tuple[int, int] | None, window: int) -> None:
        data = KVCacheUpdatedData(
            block_hash, priority=None if priority is None else KVCacheEventDiff(*priority)
        )
        self.real.enqueue_updated_event(data, window)
        self.model.updated(data, window)

    @rule()
    def flush(self) -> None:
        self.real.flush()
        self.model.flush()
        assert self.real.settle(10)

    @rule()
    def get_events(self) -> None:
        assert self.real.get_events(timeout=0) == self.model.get_events()

    @rule()
    def drain(self) -> None:
        events, drops = self.model.drain()
        expected = [RankDrops(self.rank_key, drops)] if drops else []
        got = self.real.drain(timeout=0)
        assert got.events == events
        assert got.dropped == expected

    @invariant()
    def same_counts(self) -> None:
        if not hasattr(self, "real"):
            return
        stats = self.real.stats()
        assert stats.events_enqueued_total == self.model.event_id
        assert stats.buffer.events_dropped_by_window_size == {
            w: n for w, n in self.model.dropped_by_window.items() if n
        }
        assert stats.buffer.buffered_events == len(self.model.events)

    @precondition(lambda self: hasattr(self, "real"))
    @rule()
    def close_and_read_everything(self) -> None:
        # The port's close() flushes what is queued (the C++ would discard it) and stops.
        self.real.close()
        self.model.flush()
        assert self.real.get_events() == self.model.get_events()
        self.real = self.manager_class(
            self.real.max_kv_event_entries,
            self.real.attention_dp_rank,
            self.real.attention_dp_size,
            drop_warning_interval_s=3600,
            attention_dp_gather=False,
        )
        self.model = CppModel(
            self.real.max_kv_event_entries, self.real.attention_dp_rank, self.real.attention_dp_size
        )

    def teardown(self) -> None:
        if hasattr(self, "real"):
            self.real.close()


class PurePythonManagerAgainstModel(ManagerAgainstModel):
    manager_class = PurePythonManager


_SETTINGS = settings(
    max_examples=300, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
ManagerAgainstModel.TestCase.settings = _SETTINGS
PurePythonManagerAgainstModel.TestCase.settings = _SETTINGS
test_manager_agrees_with_the_cpp_model = ManagerAgainstModel.TestCase
test_pure_python_manager_agrees_with_the_cpp_model = PurePythonManagerAgainstModel.TestCase
