"""Property: at every flush, replaying the emitted events into a naive model gives exactly the
simulator's ground truth — over random seeds, block sizes, capacities, levels, priorities,
window sizes, batch sizes and workloads."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kvevents.producer.simulator import EngineSimulator, SimulatorConfig
from kvevents.producer.simulator.workload import WorkloadConfig, WorkloadGenerator
from sim_support import RecordingEventManager, ReplayModel, truth_tuples


@st.composite
def setups(draw: st.DrawFn) -> tuple[SimulatorConfig, WorkloadConfig, int]:
    block_size = draw(st.sampled_from([1, 2, 4, 8, 16]))
    workload = WorkloadConfig(
        seed=draw(st.integers(0, 2**32)),
        content_seed=draw(st.integers(0, 3)),
        vocab_size=draw(st.sampled_from([8, 100, 32_000])),  # tiny vocabularies collide a lot
        request_rate=draw(st.floats(5.0, 200.0)),
        num_system_prompts=draw(st.integers(1, 3)),
        system_prompt_tokens=(0, draw(st.integers(0, 64))),
        num_documents=draw(st.integers(0, 8)),
        document_tokens=(1, draw(st.integers(1, 96))),
        zipf_exponent=draw(st.floats(0.0, 2.0)),
        document_probability=draw(st.floats(0.0, 1.0)),
        user_tokens=(1, draw(st.integers(1, 24))),
        output_tokens=(1, draw(st.integers(1, 40))),
        follow_up_probability=draw(st.floats(0.0, 1.0)),
        follow_up_delay_s=draw(st.sampled_from([0.0, 0.05, 0.5])),
        max_turns=draw(st.integers(1, 6)),
        max_prompt_tokens=400,
        lora_ids=(1, 2),
        lora_probability=draw(st.sampled_from([0.0, 0.3])),
        system_prompt_priority=draw(st.sampled_from([None, 20, 80])),
        document_priority=draw(st.sampled_from([None, 10, 60])),
        conversation_priority=draw(st.sampled_from([None, 35, 50])),
    )
    min_blocks = -(-workload.max_sequence_tokens // block_size)
    config = SimulatorConfig(
        block_size=block_size,
        num_primary_blocks=min_blocks + draw(st.integers(0, 3 * min_blocks)),
        num_secondary_blocks=draw(st.sampled_from([0, 0, 1, 8, min_blocks])),
        window_sizes=draw(st.sampled_from([(4096,), (256, 4096)])),
        offload_min_priority=draw(st.sampled_from([0, 30, 60])),
        max_batch_size=draw(st.integers(1, 12)),
        decode_tokens_per_iteration=draw(st.sampled_from([1, 4, 64])),
        iterations_per_second=100.0,
    )
    return config, workload, draw(st.integers(40, 250))


def _check_at_every_flush(
    config: SimulatorConfig, workload: WorkloadConfig, iterations: int
) -> EngineSimulator:
    events = RecordingEventManager()
    sim = EngineSimulator(config, events, WorkloadGenerator(workload))
    model = ReplayModel()
    flushes = []

    def on_flush() -> None:
        model.apply(events.calls)
        for window, cache in sim.caches.items():
            assert model.held(window) == truth_tuples(cache.held_blocks()), f"window {window} diverged"
            assert model.count(window, 0) <= config.num_primary_blocks
            assert model.count(window, 1) <= config.num_secondary_blocks
        sim.check_invariants()
        flushes.append(sim.iteration)

    events.on_flush = on_flush
    sim.run(max_iterations=iterations)
    sim.run(drain=True, max_iterations=0)
    assert len(flushes) == sim.iteration
    return sim


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(setups())
def test_replayed_events_equal_the_ground_truth_at_every_flush(
    setup: tuple[SimulatorConfig, WorkloadConfig, int],
) -> None:
    _check_at_every_flush(*setup)


def test_a_long_run_under_pressure_exercises_every_event_kind() -> None:
    """One fixed, heavier run: offloads, onboards, removals and priority updates all happen."""
    workload = WorkloadConfig(
        seed=42,
        request_rate=60.0,
        system_prompt_tokens=(32, 128),
        document_tokens=(32, 256),
        num_documents=20,
        user_tokens=(4, 48),
        output_tokens=(4, 48),
        max_prompt_tokens=800,
        follow_up_delay_s=0.1,
        lora_ids=(5,),
        lora_probability=0.2,
    )
    config = SimulatorConfig(block_size=8, num_primary_blocks=160, num_secondary_blocks=60, max_batch_size=8)
    sim = _check_at_every_flush(config, workload, 1500)
    s = sim.stats()
    assert min(s.offloads, s.onboards, s.removed_blocks, s.priority_updates, s.hit_blocks) > 0, s
    assert s.requests_served > 500
