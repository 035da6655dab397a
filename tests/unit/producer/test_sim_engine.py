"""The engine loop: iterations, flushes, counters, ground truth, router mode and routing hooks."""

from __future__ import annotations

import json
import time
from array import array

import pytest
from kvevents.producer.simulator import (
    CountingEventManager,
    EngineSimulator,
    GroundTruth,
    SimulatorConfig,
)
from kvevents.producer.simulator.cache import block_hashes
from kvevents.producer.simulator.workload import Request, WorkloadConfig, WorkloadGenerator
from sim_support import RecordingEventManager, ReplayModel, truth_tuples

SMALL = WorkloadConfig(
    seed=1,
    request_rate=40.0,
    system_prompt_tokens=(64, 256),
    document_tokens=(64, 512),
    num_documents=16,
    user_tokens=(8, 64),
    output_tokens=(4, 48),
    max_prompt_tokens=1500,
    follow_up_delay_s=0.2,
)


def simulator(
    workload: WorkloadConfig | None = SMALL, **config
) -> tuple[EngineSimulator, RecordingEventManager]:
    events = RecordingEventManager()
    cfg = SimulatorConfig(**{"block_size": 16, "num_primary_blocks": 256, **config})
    gen = None if workload is None else WorkloadGenerator(workload)
    return EngineSimulator(cfg, events, gen), events


def request(rid: int, prompt: list[int], output_len: int = 3, **kwargs) -> Request:
    return Request(rid, array("i", prompt), array("i", range(100, 100 + output_len)), **kwargs)


def test_created_first_then_one_flush_per_iteration() -> None:
    sim, events = simulator(window_sizes=(1024, 4096), num_secondary_blocks=32)
    stats = sim.run(duration_s=2.0)
    assert events.calls[:2] == [("created", [256, 32], 1024), ("created", [256, 32], 4096)]
    assert stats.iterations == 200 == len(events.of_kind("flush"))
    assert events.calls[-1] == ("flush",)
    assert stats.simulated_seconds == pytest.approx(2.0)


def test_counters_add_up_and_match_the_events() -> None:
    sim, events = simulator(num_secondary_blocks=64)
    s = sim.run(duration_s=5.0)
    assert s.requests_arrived == s.requests_admitted + s.requests_waiting + s.requests_rejected
    assert s.requests_admitted == s.requests_served + s.requests_running
    assert s.requests_served > 100 and s.hit_blocks > 0 and 0 < s.hit_rate < 1
    assert s.hit_tokens == 16 * s.hit_blocks
    assert s.stored_events == len(events.of_kind("stored"))
    assert s.stored_blocks == sum(len(c[1]) for c in events.of_kind("stored"))
    assert s.removed_blocks == len(events.of_kind("removed"))
    assert s.updated_events == len(events.of_kind("updated")) == s.offloads + s.onboards + s.priority_updates
    assert s.events_enqueued == len(events.calls) - len(events.of_kind("flush"))
    assert s.evictions >= s.offloads > 0 and s.onboards > 0 and s.priority_updates > 0
    sim.check_invariants()


def test_ground_truth_is_what_the_flushed_events_say() -> None:
    sim, events = simulator(num_secondary_blocks=64, window_sizes=(512, 2048))
    sim.run(duration_s=3.0)
    model = ReplayModel()
    model.apply(events.calls)
    truth = sim.ground_truth()
    for w in (512, 2048):
        assert model.held(w) == truth_tuples(truth.windows[w])
    assert truth.worker == ("sim-0", None)
    assert truth.levels(2048) == {h: (b.cache_level, b.priority) for h, b in truth.windows[2048].items()}


def test_ground_truth_survives_json() -> None:
    sim, _ = simulator(attention_dp_rank=3, instance_id="inst-a", num_secondary_blocks=16)
    sim.run(duration_s=2.0)
    truth = sim.ground_truth()
    again = GroundTruth.from_json(json.loads(json.dumps(truth.to_json())))
    assert again == truth
    assert again.worker == ("inst-a", 3) and again.block_size == 16
    assert set(json.loads(json.dumps(truth.to_json()))["windows"]) == {"8192"}


def test_the_same_seed_gives_the_same_event_stream() -> None:
    def run() -> list[tuple]:
        sim, events = simulator(num_secondary_blocks=32)
        sim.run(duration_s=2.0)
        out = []
        for c in events.calls:
            if c[0] == "stored":
                out.append(("stored", [(b.block_hash, b.prev_block_hash, b.priority) for b in c[1]], c[2]))
            else:
                out.append(c)
        return out

    assert run() == run()


def test_router_mode_serves_submitted_requests_and_reports_true_prefix_hits() -> None:
    sim, events = simulator(workload=None)
    prompt = list(range(1, 16 * 4 + 6))  # 4 full blocks + 5 tokens
    first = request(1, prompt)
    assert sim.reusable_blocks(first) == 0
    sim.submit(first)
    assert sim.step().admitted == 1
    while not sim.idle:
        sim.step()
    assert sim.prefix_hit_blocks(prompt) == 4
    assert sim.prefix_hit_blocks(prompt, lora_id=3) == 0
    second = request(2, prompt)
    assert sim.reusable_blocks(second) == 4
    stored_before = len(events.of_kind("stored"))
    sim.submit(second)
    report = sim.step()
    assert report.admitted == 1 and report.hit_blocks == 4
    while not sim.idle:
        sim.step()
    assert len(events.of_kind("stored")) == stored_before  # same prompt, same answer: nothing new
    truth = sim.ground_truth()
    assert truth.prefix_hit_blocks(prompt) == 4
    assert truth.prefix_hit_blocks([*prompt, 1, 2, 3]) == 4
    assert sim.stats().requests_served == 2


def test_a_request_longer_than_the_cache_is_rejected_and_counted() -> None:
    sim, _ = simulator(workload=None, num_primary_blocks=4, block_size=4)
    sim.submit(request(1, list(range(40))))
    sim.submit(request(2, list(range(5))))
    sim.step()
    s = sim.stats()
    assert s.requests_rejected == 1 and s.requests_admitted == 1


def test_admission_waits_for_blocks_and_batch_room() -> None:
    sim, _ = simulator(workload=None, num_primary_blocks=8, block_size=4, max_batch_size=2)
    for i in range(4):
        sim.submit(request(i, [i * 100 + t for t in range(9)], output_len=10))  # 5 blocks each
    report = sim.step()
    assert report.admitted == 1 and sim.num_waiting == 3  # the second does not fit yet
    while sim.num_waiting:
        sim.step()
        sim.check_invariants()
        assert sim.num_running <= 2
    sim.run(drain=True, max_iterations=0)
    assert sim.idle and sim.stats().requests_served == 4


def test_run_limits_duration_requests_and_stop() -> None:
    sim, _ = simulator()
    s = sim.run(max_requests=25, drain=True)
    assert s.requests_arrived == 25 and s.requests_served == 25 and sim.idle
    sim2, _ = simulator()
    calls = []
    s2 = sim2.run(should_stop=lambda: calls.append(1) or len(calls) > 10)
    assert s2.iterations == 10
    sim3, _ = simulator()
    with pytest.raises(ValueError, match="endless"):
        sim3.run()


def test_a_finite_workload_runs_to_its_end() -> None:
    requests = WorkloadGenerator(SMALL).take(30)
    sim = EngineSimulator(SimulatorConfig(block_size=16, num_primary_blocks=256), None, requests)
    s = sim.run()
    assert s.requests_served == 30 and sim.idle


def test_realtime_keeps_the_wall_clock_pace() -> None:
    sim, _ = simulator(iterations_per_second=50.0, realtime=True)
    start = time.monotonic()
    sim.run(duration_s=0.3)
    assert time.monotonic() - start >= 0.28
    assert sim.iteration == 15


class _FakeClock:
    """time.monotonic / time.sleep of the engine module: the clock moves only when it sleeps."""

    def __init__(self) -> None:
        self.now = 100.0
        self.sleeps: list[float] = []

    def monotonic(self) -> float:
        return self.now

    def sleep(self, delay: float) -> None:
        self.sleeps.append(delay)
        self.now += delay


@pytest.mark.parametrize(
    ("ips", "slack", "sleeps"),
    [
        (1000.0, 0.0, 100),  # a sleep per iteration, as before the slack
        (1000.0, 0.0045, 20),  # runs up to 4.5 ms ahead, then sleeps back to the schedule
        (100.0, 0.001, 100),  # iterations longer than the slack: each one paced
    ],
)
def test_realtime_sleeps_only_once_the_slack_is_reached(
    monkeypatch: pytest.MonkeyPatch, ips: float, slack: float, sleeps: int
) -> None:
    from kvevents.producer.simulator import engine

    clock = _FakeClock()
    monkeypatch.setattr(engine.time, "monotonic", clock.monotonic)
    monkeypatch.setattr(engine.time, "sleep", clock.sleep)
    sim, events = simulator(iterations_per_second=ips, realtime=True, pace_slack_s=slack)
    start = clock.now
    flushed_at: list[float] = []
    events.on_flush = lambda: flushed_at.append(clock.now)
    sim.run(max_iterations=100)
    assert len(clock.sleeps) == sleeps
    assert clock.now - start == pytest.approx(100 / ips)  # the same pace overall
    for i, at in enumerate(flushed_at):  # never late, at most the slack early
        assert start + i / ips - slack - 1e-9 <= at <= start + i / ips + 1e-9


def test_pace_slack_must_not_be_negative() -> None:
    with pytest.raises(ValueError, match="pace_slack_s"):
        SimulatorConfig(pace_slack_s=-0.001)


def test_counting_event_manager_counts_every_call() -> None:
    counter = CountingEventManager()
    sim = EngineSimulator(
        SimulatorConfig(block_size=16, num_primary_blocks=128, num_secondary_blocks=32),
        counter,
        WorkloadGenerator(SMALL),
    )
    s = sim.run(duration_s=4.0)
    assert counter.calls == s.events_enqueued and counter.flushes == s.iterations
    assert counter.stored_blocks == s.stored_blocks and counter.removed_calls == s.removed_blocks


def test_routing_by_true_prefix_hits_beats_round_robin_on_held_out_requests() -> None:
    """The hook the demo uses: each worker tells its true prefix hit for a request."""
    workers = []
    gens = []
    for rank in range(4):
        cfg = WorkloadConfig(**{**SMALL.__dict__, "seed": 100 + rank, "follow_up_delay_s": 0.0})
        gen = WorkloadGenerator(cfg)
        sim = EngineSimulator(
            SimulatorConfig(attention_dp_rank=rank, block_size=16, num_primary_blocks=512), None, gen
        )
        sim.run(duration_s=3.0, drain=True)
        workers.append(sim)
        gens.append(gen)
    held = [r for g in gens for r in g.held_out(40, seed=5)]
    best = sum(max(w.reusable_blocks(r) for w in workers) for r in held)
    round_robin = sum(workers[i % 4].reusable_blocks(r) for i, r in enumerate(held))
    possible = sum((len(r.prompt) - 1) // 16 for r in held)
    assert round_robin < best <= possible
    assert best > 1.2 * round_robin, (best, round_robin, possible)
    truths = [w.ground_truth() for w in workers]
    for r in held[:20]:
        assert [t.prefix_hit_blocks(r.prompt[:-1], r.lora_id) for t in truths] == [
            w.reusable_blocks(r) for w in workers
        ]


def test_bad_simulator_configs_are_refused() -> None:
    with pytest.raises(ValueError, match="window_sizes"):
        SimulatorConfig(window_sizes=(8, 8))
    with pytest.raises(ValueError, match="iterations_per_second"):
        SimulatorConfig(iterations_per_second=0)
    with pytest.raises(ValueError, match="max_batch_size"):
        SimulatorConfig(max_batch_size=0)


def test_hashes_in_events_are_the_chained_hashes_of_the_tokens() -> None:
    sim, events = simulator()
    sim.run(duration_s=1.0)
    for _, blocks, _ in events.of_kind("stored"):
        parent = blocks[0].prev_block_hash
        for b in blocks:
            assert block_hashes(list(b.tokens), 16, b.lora_id, parent_hash=parent) == [b.block_hash]
            parent = b.block_hash


def test_arrivals_at_a_full_waiting_queue_are_rejected_and_counted() -> None:
    sim, _ = simulator(workload=None, max_waiting_requests=2, max_batch_size=1)
    accepted = [sim.submit(request(i, list(range(i, i + 20)))) for i in range(5)]
    assert accepted == [True, True, False, False, False]
    s = sim.run(drain=True, max_iterations=0)
    assert s.requests_arrived == 5 and s.requests_rejected == 3 and s.requests_served == 2
