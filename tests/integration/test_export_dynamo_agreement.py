"""Agreement with NVIDIA Dynamo: the same simulated topic (real managers, offload to a secondary
level, LoRA adapters) feeds kvevents' ``CacheIndex`` and Dynamo's own ``RadixTree`` (PyPI
``ai-dynamo-runtime``, the ``bench-dynamo`` extra, installed in CI) through
``kvevents.consumer.dynamo.router_events``; both must score every worker identically for a few
thousand requests, and the tree must accept every event."""

from __future__ import annotations

import dataclasses
import json

import pytest
from cli_streams import BLOCK_SIZE, WORKLOAD, simulate_to_topic
from kvevents.consumer import CacheIndex, EventReader, WorkerKey
from kvevents.consumer.dynamo import local_block_hashes, router_events, worker_id_for
from kvevents.producer.simulator.workload import WorkloadGenerator

pytestmark = pytest.mark.kafka

INSTANCES = ("dyn-a", "dyn-b")
RANKS = 2
LORA_WORKLOAD = dataclasses.replace(WORKLOAD, lora_ids=(3, 9), lora_probability=0.3)


def test_dynamo_radix_tree_ranks_workers_like_the_index(kafka_bootstrap: str, kafka_topic: str) -> None:
    from dynamo.llm import RadixTree  # the bench-dynamo extra: CI installs it, so no skip

    produced = simulate_to_topic(
        kafka_bootstrap, kafka_topic, instances=INSTANCES, ranks=RANKS, iterations=200, workload=LORA_WORKLOAD
    )
    index = CacheIndex()
    tree = RadixTree()
    ids = {name: worker_id_for(name) for name in INSTANCES}
    names = {v: k for k, v in ids.items()}
    kinds: dict[str, int] = {}
    with EventReader(kafka_bootstrap, kafka_topic) as reader:
        for batch in reader.batches(until_caught_up=True):
            index.apply(batch)
            for key, event in router_events(batch):
                kind = event["data"] if isinstance(event["data"], str) else next(iter(event["data"]))
                kinds[kind] = kinds.get(kind, 0) + 1
                tree.apply_event(ids[key.instance_id], json.dumps(event).encode())  # raises if refused
    assert kinds.get("stored", 0) > 100 and kinds.get("removed", 0) > 10 and kinds.get("cleared") == 4, kinds
    assert not index.degraded_workers()
    # Updated events have no Dynamo counterpart
    assert sum(len(b.events) for b in produced.sent) > sum(kinds.values())

    queries = []
    for name in INSTANCES:
        for rank in range(RANKS):
            queries += WorkloadGenerator(LORA_WORKLOAD.for_worker(name, rank)).held_out(800, seed=11)
    compared = matched = differing = 0
    for request in queries:
        lora_name = None if request.lora_id is None else str(request.lora_id)
        ours = index.find_matches_for_tokens(request.prompt, BLOCK_SIZE, request.lora_id)
        theirs = tree.find_matches(local_block_hashes(request.prompt, BLOCK_SIZE, lora_name)).scores
        theirs_by_key = {
            WorkerKey(names[worker_id], rank): count for (worker_id, rank), count in theirs.items() if count
        }
        compared += 1
        matched += bool(ours)
        if ours != theirs_by_key:
            differing += 1
    assert compared >= 3000
    assert matched > compared // 4, "the queries must hit cached prefixes for the comparison to mean much"
    assert differing == 0, f"{differing} of {compared} requests scored differently"
