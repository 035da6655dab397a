"""A digest of everything a simulated engine hands its event manager, for pinning the stream.

``StreamDigest`` is an event manager that feeds every ``enqueue_*`` call (every field of every
``BlockInfo`` / ``KVCacheUpdatedData``, token ids as bytes), every flush and every snapshot into
one SHA-256. ``CASES`` are fixed seeds and shapes (the freshness bench's rank shape among them);
``digest(case)`` runs one and returns the hex digest together with the ground truth's digest.
``tests/unit/producer/test_sim_stream_pinned.py`` compares them with values recorded from the
simulator before it was made cheaper: any change to the stream, its order or its flush
boundaries fails it.

One order is not pinned: within a run of consecutive Removed calls of one window, the hashes
are digested sorted (unless ``sort_removed=False``). The simulator at 4e4074c, whose digests are
pinned, removed an evicted subtree's sibling branches in the iteration order of a ``set`` of
blocks, which followed their memory addresses; children are now kept in insertion order, and
``test_stream_repeats_in_exact_order`` checks the exact order repeats.

    python tests/unit/producer/sim_stream_digest.py     # print the digests of the current code
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Any

from kvevents.producer.simulator import EngineSimulator, SimulatorConfig
from kvevents.producer.simulator.run_config import SimRunConfig
from kvevents.producer.simulator.workload import WorkloadConfig, WorkloadGenerator


class StreamDigest:
    """An event manager that hashes the calls it is given (and keeps nothing else)."""

    snapshot_requested = False

    def __init__(self, *, sort_removed: bool = True) -> None:
        self._sort_removed = sort_removed
        self._h = hashlib.sha256()
        self.calls = 0
        self._removed: list[int] = []
        self._removed_window: int | None = None

    def _end_removed(self) -> None:
        if self._removed:
            removed, self._removed = self._removed, []
            self._put("removed", sorted(removed) if self._sort_removed else removed, self._removed_window)

    def _feed(self, *parts: object) -> None:
        self._end_removed()
        self._put(*parts)

    def _put(self, *parts: object) -> None:
        self.calls += 1
        for part in parts:
            if isinstance(part, bytes | bytearray):
                self._h.update(b"b%d:" % len(part))
                self._h.update(part)
            else:
                text = repr(part).encode()
                self._h.update(b"r%d:" % len(text))
                self._h.update(text)

    def _block(self, b: Any) -> None:
        self._put(
            "B", b.block_hash, b.prev_block_hash, b.tokens.typecode, b.tokens.tobytes(), b.lora_id,
            b.is_primary, b.priority, b.token_extra_ids, b.mm_keys, b.cache_salt,
        )  # fmt: skip

    def enqueue_created_event(self, num_blocks_per_cache_level: list[int], window_size: int) -> None:
        self._feed("created", list(num_blocks_per_cache_level), window_size)

    def enqueue_stored_event(self, blocks: list[Any], window_size: int) -> None:
        self._feed("stored", len(blocks), window_size)
        for b in blocks:
            self._block(b)

    def enqueue_removed_event(self, block_hash: int, window_size: int) -> None:
        if window_size != self._removed_window:
            self._end_removed()
            self._removed_window = window_size
        self._removed.append(block_hash)

    def enqueue_updated_event(self, data: Any, window_size: int) -> None:
        level, prio = data.cache_level, data.priority
        self._feed(
            "updated", data.block_hash, window_size,
            None if level is None else (level.old_value, level.new_value),
            None if prio is None else (prio.old_value, prio.new_value),
        )  # fmt: skip

    def enqueue_snapshot(self, blocks: dict[int, list[Any]], levels: dict[int, list[int]]) -> None:
        self._feed("snapshot", sorted(blocks), {w: list(v) for w, v in levels.items()})
        for w in blocks:
            self._put("window", w, len(blocks[w]))
            for b in blocks[w]:
                self._block(b)

    def flush(self) -> None:
        self._feed("flush")

    def hexdigest(self) -> str:
        self._end_removed()
        return self._h.hexdigest()


def _bench_rank(rank: int, iterations: int, realtime_rate: float = 640.0) -> dict[str, Any]:
    """One rank of ``bench/freshness.py``'s top step (``kvevents simulate``'s defaults)."""
    return {
        "run": {"rate": realtime_rate, "rank": rank, "ranks": 4},
        "simulator": {
            "block_size": 32, "num_primary_blocks": 1024, "num_secondary_blocks": 256,
            "iterations_per_second": max(100.0, 10.0 * realtime_rate), "max_batch_size": 64,
        },
        "iterations": iterations,
    }  # fmt: skip


_SMALL = {
    "request_rate": 40.0, "system_prompt_tokens": (64, 256), "document_tokens": (64, 512),
    "num_documents": 16, "user_tokens": (8, 64), "output_tokens": (4, 48), "max_prompt_tokens": 1500,
    "follow_up_delay_s": 0.2,
}  # fmt: skip

CASES: dict[str, dict[str, Any]] = {
    "bench-640-rank0": _bench_rank(0, 2500),
    "bench-640-rank3": _bench_rank(3, 2500),
    "bench-160-rank1": _bench_rank(1, 2500, 160.0),
    "defaults": {"simulator": {}, "workload": {"seed": 7}, "iterations": 3000},
    "offload-lora-two-windows": {
        "simulator": {
            "block_size": 16,
            "num_primary_blocks": 256,
            "num_secondary_blocks": 64,
            "window_sizes": (4096, 512),
            "max_batch_size": 16,
            "decode_tokens_per_iteration": 3,
            "iterations_per_second": 50.0,
        },
        "workload": {
            **_SMALL,
            "seed": 3,
            "lora_ids": (1, 2),
            "lora_probability": 0.4,
            "document_priority": 20,
            "conversation_priority": 60,
        },
        "iterations": 1500,
        "snapshot_every": 250,
    },
    "tiny-cache-low-priority": {
        "simulator": {
            "block_size": 8,
            "num_primary_blocks": 160,
            "num_secondary_blocks": 24,
            "max_batch_size": 8,
            "offload_min_priority": 40,
            "iterations_per_second": 20.0,
            "max_waiting_requests": 20,
        },
        "workload": {
            **_SMALL,
            "seed": 11,
            "request_rate": 80.0,
            "system_prompt_priority": 35,
            "conversation_priority": None,
            "document_priority": 90,
        },
        "iterations": 1200,
        "snapshot_every": 300,
        "drain": True,
    },
}


def digest(name: str, *, sort_removed: bool = True) -> tuple[str, str, int]:
    """(stream digest, ground-truth digest, calls) of one case; ``sort_removed=False`` digests
    Removed runs in the order they were emitted (for checking that a run repeats exactly)."""
    case = CASES[name]
    if "run" in case:
        r = case["run"]
        run_cfg = SimRunConfig(duration_s=1.0, workload=WorkloadConfig(request_rate=r["rate"]))
        workload = run_cfg.workload_for("sim-0", r["rank"])
        sim_cfg = SimulatorConfig(instance_id="sim-0", attention_dp_rank=r["rank"], **case["simulator"])
    else:
        workload = WorkloadConfig(**case["workload"])
        sim_cfg = SimulatorConfig(**case["simulator"])
    events = StreamDigest(sort_removed=sort_removed)
    sim = EngineSimulator(sim_cfg, events, WorkloadGenerator(workload))
    every = case.get("snapshot_every")
    for i in range(case["iterations"]):
        sim.step()
        if every and i % every == every - 1:
            sim.publish_snapshot()
    if case.get("drain"):
        sim.run(drain=True, max_requests=0)
    truth = json.dumps(sim.ground_truth().to_json(), sort_keys=True)
    stats = json.dumps(dataclasses.asdict(sim.stats()), sort_keys=True)
    return events.hexdigest(), hashlib.sha256((truth + stats).encode()).hexdigest(), events.calls


if __name__ == "__main__":
    import time

    for case_name in CASES:
        t0 = time.process_time()
        stream, truth, calls = digest(case_name)
        print(f'    "{case_name}": ("{stream}", "{truth}", {calls}),  # {time.process_time() - t0:.2f} s')
