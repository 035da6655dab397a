"""``kvevents.routing_eval``: a request's true hit from the ground truth is what the simulator
itself would reuse, and routing by an index that equals the truth reaches the best possible
hit rate, ahead of round-robin and random on a workload with private conversation prefixes."""

from __future__ import annotations

from kvevents.consumer import CacheIndex
from kvevents.producer import KVCacheEventManager
from kvevents.producer.simulator import EngineSimulator, SimulatorConfig, held_prefix_length
from kvevents.producer.simulator.cache import block_hashes
from kvevents.producer.simulator.workload import WorkloadConfig, WorkloadGenerator
from kvevents.schemas import EventBatch

from kvevents.routing_eval import evaluate_routing

WORKLOAD = WorkloadConfig(
    seed=11,
    request_rate=30.0,
    system_prompt_tokens=(32, 64),
    document_tokens=(64, 256),
    num_documents=40,
    user_tokens=(16, 64),
    output_tokens=(8, 32),
    max_prompt_tokens=1000,
    follow_up_delay_s=0.1,
    follow_up_probability=0.8,
)


def run_worker(name: str, index: CacheIndex) -> tuple[EngineSimulator, WorkloadGenerator]:
    generator = WorkloadGenerator(WORKLOAD.for_worker(name, None))
    config = SimulatorConfig(instance_id=name, block_size=16, num_primary_blocks=400)
    with KVCacheEventManager(max_kv_event_entries=100_000) as manager:
        sim = EngineSimulator(config, manager, generator)
        sim.run(max_iterations=150)
        assert manager.settle(timeout=30)
        index.apply(EventBatch(name, manager.drain(timeout=0).events))
    return sim, generator


def test_true_hits_from_the_truth_are_the_simulators_own_reusable_blocks():
    index = CacheIndex()
    sim, generator = run_worker("w0", index)
    held = set(sim.ground_truth().windows[next(iter(sim.caches))])
    requests = generator.held_out(60, seed=1)
    hits = [
        held_prefix_length(block_hashes(r.prompt, 16, r.lora_id, max_blocks=(len(r.prompt) - 1) // 16), held)
        for r in requests
    ]
    assert hits == [sim.reusable_blocks(r) for r in requests]
    assert sum(hits) > 0


def test_routing_by_an_exact_index_is_best_and_beats_round_robin_and_random():
    index = CacheIndex()
    workers = [run_worker(f"w{i}", index) for i in range(4)]
    truths = [sim.ground_truth() for sim, _ in workers]
    requests = [r for _, generator in workers for r in generator.held_out(50, seed=2)]
    result = evaluate_routing(index, truths, requests, seed=3)
    assert result.requests == 200 and result.reusable_blocks > 0
    assert result.hit_blocks["index"] == result.hit_blocks["oracle"]
    assert result.hit_rate("index") > result.hit_rate("round_robin") + 0.1
    assert result.hit_rate("index") > result.hit_rate("random") + 0.1
    blind = evaluate_routing(CacheIndex(), truths, requests, seed=3)  # an index that knows nothing:
    assert blind.hit_blocks["index"] == blind.hit_blocks["round_robin"]  # every worker ties, taken in turn
