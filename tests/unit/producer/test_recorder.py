"""The engine path's two implementations (compiled ``Recorder``, pure-Python ``PyRecorder``): how
the manager picks one, the flat records both hand the worker, and the worker's exact truncation of
several flushed iterations at once. Their observable behaviour through the manager is pinned by
the manager's test modules, which run on both."""

from __future__ import annotations

from collections import deque
from typing import Any

import pytest
from kvevents.producer import BlockInfo, KVCacheEventManager
from kvevents.producer._recorder import PyRecorder, recorder_class
from kvevents.producer._worker import Worker
from kvevents.producer.buffer import EventBuffer
from kvevents.schemas import KVCacheRemovedData, KVCacheUpdatedData


def test_the_manager_uses_the_compiled_recorder_unless_pure_python_is_asked(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from kvevents.producer._fastrecorder import Recorder

    monkeypatch.delenv("KVEVENTS_PURE_PYTHON", raising=False)
    assert recorder_class() is Recorder
    with KVCacheEventManager(10) as m:
        assert type(m._recorder) is Recorder
        assert m.flush == m._recorder.flush  # the engine's call goes straight to the recorder
    monkeypatch.setenv("KVEVENTS_PURE_PYTHON", "1")
    assert recorder_class() is PyRecorder
    with KVCacheEventManager(10) as m:
        assert type(m._recorder) is PyRecorder


def test_a_subclass_override_of_an_engine_method_is_kept() -> None:
    calls = []

    class Counting(KVCacheEventManager):
        def flush(self) -> None:
            calls.append("flush")
            super().flush()

    with Counting(10) as m:
        m.enqueue_removed_event(1, 16)
        m.flush()
        assert calls == ["flush"]
        assert m.settle(5)
        assert [e.event_id for e in m.get_events(timeout=0)] == [0]


class _Worker:
    parked = False


def _recorders() -> list[Any]:
    from kvevents.producer._fastrecorder import Recorder

    return [Recorder(deque(), _Worker()), PyRecorder(deque(), _Worker())]


@pytest.mark.parametrize("recorder", _recorders(), ids=["compiled", "python"])
def test_flush_hands_the_first_id_and_flat_records(recorder: Any) -> None:
    a, b = BlockInfo(1, None, [1]), BlockInfo(2, 1, [2])
    update = KVCacheUpdatedData(5)
    engine_list = [a]
    recorder.enqueue_stored_event(engine_list, 16)
    engine_list[0] = b  # the engine reuses its list: the record keeps what was given
    recorder.enqueue_stored_event([a, b], 16)
    recorder.enqueue_removed_event(7, 16)
    recorder.enqueue_removed_event(8, 32)
    recorder.enqueue_removed_event(9, 32)  # merged: the single hash becomes a list
    recorder.enqueue_removed_event(10, 32)
    recorder.enqueue_updated_event(update, 16)
    recorder.flush()
    recorder.enqueue_removed_event(11, 16)
    recorder.flush()
    assert list(recorder.pending) == [
        (0, [16, a, 16, (a, b), 16, 7, 32, [8, 9, 10], 16, update]),
        (5, [16, 11]),
    ]
    assert recorder.next_id == 6 and recorder.iterations_flushed == 2


def test_the_worker_truncates_several_iterations_at_once_exactly() -> None:
    # capacity 3; iterations of 3, 2 and 2 events arrive together: the 4 oldest are dropped
    # (the whole first iteration and the first event of the second) without being built.
    buffer = EventBuffer(3, drop_warning_interval_s=3600)
    worker = Worker(buffer, None)
    block = BlockInfo(1, None, [1])
    iterations = [
        (0, [16, 100, 16, block, 32, (block, block)]),
        (3, [32, [101, 102], 16, 103]),
        (5, [16, KVCacheUpdatedData(9), 64, 104]),
    ]
    worker._process(iterations)
    events = buffer.take(0)
    assert [e.event_id for e in events] == [4, 5, 6]
    assert events[0].data == KVCacheRemovedData([103])
    assert events[2].data == KVCacheRemovedData([104]) and events[2].window_size == 64
    stats = buffer.stats()
    assert stats.events_dropped_total == 4
    assert stats.events_dropped_by_window_size == {16: 2, 32: 2}
    assert worker.events_by_type == {"created": 0, "stored": 2, "removed": 4, "updated": 1}
    assert worker.stored_blocks == 3 and worker.removed_hashes == 5
