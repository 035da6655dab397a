"""The simulator driving the real ``KVCacheEventManager``: what the manager delivers replays to
the simulator's ground truth, with event ids in order and nothing dropped."""

from __future__ import annotations

from kvevents.producer import KVCacheEventManager
from kvevents.producer.simulator import EngineSimulator, SimulatorConfig
from kvevents.producer.simulator.workload import WorkloadConfig, WorkloadGenerator
from kvevents.schemas import KVCacheRemovedData
from sim_support import ReplayModel, truth_tuples

WORKLOAD = WorkloadConfig(
    seed=21,
    request_rate=40.0,
    system_prompt_tokens=(64, 256),
    document_tokens=(64, 512),
    num_documents=16,
    user_tokens=(8, 64),
    output_tokens=(4, 48),
    max_prompt_tokens=1500,
    follow_up_delay_s=0.2,
)


def test_events_delivered_by_the_real_manager_replay_to_the_ground_truth() -> None:
    config = SimulatorConfig(
        block_size=16, num_primary_blocks=200, num_secondary_blocks=64, window_sizes=(512, 2048)
    )
    with KVCacheEventManager(max_kv_event_entries=1_000_000) as manager:
        sim = EngineSimulator(config, manager, WorkloadGenerator(WORKLOAD))
        model = ReplayModel()
        last_id = -1
        delivered = 0
        for _ in range(8):
            sim.run(max_iterations=60)
            assert manager.settle(timeout=30)
            events = manager.get_events(timeout=0)
            ids = [e.event_id for e in events]
            assert ids == sorted(set(ids)) and (not ids or ids[0] > last_id)
            last_id = ids[-1] if ids else last_id
            delivered += len(events)
            model.apply_events(events)
            truth = sim.ground_truth()
            for window in config.window_sizes:
                assert model.held(window) == truth_tuples(truth.windows[window])
        stats = manager.stats()
        s = sim.stats()
        assert stats.buffer.events_dropped_total == 0
        assert (
            stats.stored_blocks_total == s.stored_blocks
            and stats.removed_block_hashes_total == s.removed_blocks
        )
        assert s.offloads and s.onboards and s.removed_blocks and s.priority_updates


def test_consecutive_removals_merge_into_one_removed_event() -> None:
    # No secondary level: an eviction burst is a run of Removed calls with nothing in between.
    config = SimulatorConfig(block_size=16, num_primary_blocks=120)
    with KVCacheEventManager(max_kv_event_entries=1_000_000) as manager:
        sim = EngineSimulator(config, manager, WorkloadGenerator(WORKLOAD))
        sim.run(max_iterations=400)
        assert manager.settle(timeout=30)
        events = manager.get_events(timeout=0)
    removed = [e.data for e in events if isinstance(e.data, KVCacheRemovedData)]
    assert sum(len(r.block_hashes) for r in removed) == sim.stats().removed_blocks
    assert len(removed) < sim.stats().removed_blocks  # merged, as the C++ manager does
    assert max(len(r.block_hashes) for r in removed) > 1
