"""``kvevents.verify``: an index fed every event of a simulated engine equals its ground truth;
lost, altered or foreign state is reported, worker by worker, with the first differences."""

from __future__ import annotations

import json

import pytest
from kvevents.consumer import CacheIndex, WorkerKey
from kvevents.producer import KVCacheEventManager
from kvevents.producer.simulator import EngineSimulator, SimulatorConfig
from kvevents.producer.simulator.workload import WorkloadConfig, WorkloadGenerator
from kvevents.schemas import (
    EventBatch,
    KVCacheEvent,
    KVCacheEventDiff,
    KVCacheRemovedData,
    KVCacheUpdatedData,
    encode_batch,
)

from kvevents.verify import compare, load_ground_truth

WORKLOAD = WorkloadConfig(
    seed=3,
    request_rate=40.0,
    system_prompt_tokens=(64, 128),
    document_tokens=(64, 256),
    num_documents=16,
    user_tokens=(8, 32),
    output_tokens=(4, 24),
    max_prompt_tokens=800,
    follow_up_delay_s=0.1,
)


def simulate(instance_id: str, iterations: int = 60) -> tuple[EngineSimulator, list[EventBatch]]:
    config = SimulatorConfig(
        instance_id=instance_id, block_size=16, num_primary_blocks=96, num_secondary_blocks=32
    )
    with KVCacheEventManager(max_kv_event_entries=100_000) as manager:
        sim = EngineSimulator(config, manager, WorkloadGenerator(WORKLOAD.for_worker(instance_id, None)))
        sim.run(max_iterations=iterations)
        assert manager.settle(timeout=30)
        events = manager.drain(timeout=0).events
    return sim, [EventBatch(instance_id, events, producer_id=1, sequence=0)]


def test_an_index_fed_every_event_equals_the_ground_truth_and_a_file_round_trips(tmp_path):
    index = CacheIndex()
    sims = []
    for name in ("a", "b"):
        sim, batches = simulate(name)
        for batch in batches:
            index.apply_encoded(encode_batch(batch))
        sims.append(sim)
    path = tmp_path / "truth.jsonl"
    path.write_text("".join(json.dumps(s.ground_truth().to_json()) + "\n" for s in sims))
    report = compare(index, load_ground_truth(path))
    assert report.ok, report.describe()
    assert [w.blocks for w in report.workers] == [
        sum(map(len, s.ground_truth().windows.values())) for s in sims
    ]
    assert all(w.blocks > 0 for w in report.workers)
    assert report.to_json()["ok"] is True


def test_lost_changed_and_foreign_state_are_reported_per_worker():
    sim, batches = simulate("a")
    truth = sim.ground_truth()
    index = CacheIndex()
    for batch in batches:
        index.apply(batch)
    window, held = next(iter(truth.windows.items()))
    victim, promoted = sorted(held)[:2]
    last = batches[-1].events[-1].event_id
    tampered = [
        KVCacheEvent(last + 1, KVCacheRemovedData([victim]), window),
        KVCacheEvent(
            last + 2,
            KVCacheUpdatedData(promoted, priority=KVCacheEventDiff(held[promoted].priority, 99)),
            window,
        ),
    ]
    index.apply(EventBatch("a", tampered, producer_id=1, sequence=1))
    _, other_batches = simulate("stranger", iterations=10)
    index.apply(other_batches[0])

    report = compare(index, [truth])
    assert not report.ok and report.unexpected == [("stranger", 0)]
    (worker,) = report.workers
    assert not worker.equal and worker.missing_total == 1 and worker.changed_total == 1
    assert worker.missing == {window: [victim]}
    assert worker.changed[window] == [
        (promoted, (held[promoted].cache_level, held[promoted].priority), (held[promoted].cache_level, 99))
    ]
    text = report.describe()
    assert "DIFFERS" in text and f"{victim:#x}" in text and "stranger/0" in text


def test_a_degraded_or_unknown_worker_fails_the_check():
    sim, batches = simulate("a")
    index = CacheIndex()
    for batch in batches:
        index.apply(batch)
    index.mark_degraded(WorkerKey("a", 0), "test: events lost")
    report = compare(index, [sim.ground_truth()])
    assert report.workers[0].equal and report.workers[0].degraded and not report.ok
    assert report.equal  # the blocks are right: `index --verify` passes, the demo's stricter ok does not
    assert report.to_json()["equal"] is True and report.to_json()["ok"] is False
    assert "test: events lost" in report.describe()
    assert not compare(CacheIndex(), [sim.ground_truth()]).workers[0].known


def test_a_bad_ground_truth_file_is_named(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text('{"instance_id": "x"}\n')
    with pytest.raises(ValueError, match=r"t.jsonl:1: not a ground-truth line"):
        load_ground_truth(path)
    path.write_text("\n")
    with pytest.raises(ValueError, match="no ground-truth line"):
        load_ground_truth(path)
