"""The bench's own baselines must not silently give wrong answers: the naive index
(``bench/support/index_naive.py``) answers as ``CacheIndex`` does, and the synthetic fleet's
hand-written Avro bytes (``bench/support/index_fleet.py``) are what ``encode_batch`` writes."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest
from kvevents.consumer import CacheIndex
from kvevents.consumer.index import compiled_core_available
from kvevents.schemas import (
    EventBatch,
    KVCacheCreatedData,
    KVCacheEvent,
    KVCacheRemovedData,
    KVCacheStoredBlockData,
    KVCacheStoredData,
    decode_batch,
    encode_batch,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "bench" / "support"))

from index_fleet import FleetConfig, fleet_instance_id, generate_fleet, make_fleet_queries
from index_naive import NaiveIndex
from index_stream import StreamConfig, generate


@pytest.fixture(params=["python", "compiled"])
def core(request: pytest.FixtureRequest) -> str:
    if request.param == "compiled" and not compiled_core_available():
        pytest.fail("kvevents.consumer._indexcore is not built")
    return str(request.param)


def answers(index: CacheIndex, query: list[int]) -> dict[tuple[str, int], int]:
    return {(k.instance_id, k.attention_dp_rank): v for k, v in index.find_matches(query).items()}


def stored(event_id: int, rank: int, parent: int | None, hashes: list[int]) -> KVCacheEvent:
    blocks = [KVCacheStoredBlockData(h, [h % 1000, 7]) for h in hashes]
    return KVCacheEvent(event_id, KVCacheStoredData(parent, blocks), 64, rank)


def test_naive_index_follows_stored_removed_and_created() -> None:
    naive = NaiveIndex()
    naive.apply(
        EventBatch(
            "a",
            [
                stored(0, 0, None, [1, 2, 3, 4]),
                stored(0, 1, None, [1, 2]),
                stored(1, 1, 2, [9]),
                KVCacheEvent(2, KVCacheRemovedData([2]), 64, 1),
            ],
            attention_dp_size=2,
        )
    )
    assert naive.find_matches([1, 2, 3, 5]) == {("a", 0): 3, ("a", 1): 1}
    assert naive.find_matches([7, 1]) == {}
    assert naive.held_blocks() == 4 + 2
    naive.apply(
        EventBatch("a", [KVCacheEvent(1, KVCacheCreatedData([16]), 64, 0)], attention_dp_size=2, sequence=1)
    )
    assert naive.find_matches([1, 2, 3]) == {("a", 1): 1}
    assert 3 not in naive.holders


def test_naive_index_answers_as_cache_index_on_a_simulated_stream(core: str) -> None:
    config = StreamConfig(
        instances=4,
        dp_size=2,
        target_events=4000,
        primary_blocks=96,
        secondary_blocks=32,
        documents=20,
        seed=5,
    )
    stream = generate(config)
    index, naive = CacheIndex(core=core), NaiveIndex()
    for batch in stream.batches:
        index.apply_encoded(encode_batch(batch))
        naive.apply(batch)
    assert naive.held_blocks() == index.held_blocks() == stream.held_worker_blocks
    assert stream.events_by_kind["KVCacheRemovedData"] > 0 and stream.events_by_kind["KVCacheUpdatedData"] > 0
    rng = random.Random(1)
    matched = 0
    for _, path in stream.conversations:
        hashes = [stream.engine_hashes[b] for b in path]
        for query in (hashes, [*hashes[: rng.randint(1, len(hashes))], rng.getrandbits(64)]):
            expected = answers(index, query)
            assert naive.find_matches(query) == expected
            matched += bool(expected)
    assert matched >= 50  # the queries hit held blocks, not only misses


def test_fleet_bytes_are_encode_batch_bytes_and_every_index_agrees() -> None:
    stream = generate_fleet(FleetConfig(workers=16, blocks_per_worker=600, seed=3), sample_paths=64)
    index, naive = CacheIndex(), NaiveIndex()
    for data in stream.batches:
        batch = decode_batch(data)
        assert encode_batch(batch) == data
        index.apply_encoded(data)
        naive.apply(batch)
    assert index.held_blocks() == naive.held_blocks() == stream.held_worker_blocks
    assert index.counters()["blocks_removed"] > 0 and index.stats().degraded_workers == 0
    # the Dynamo events describe the same stream: same block counts per worker
    dyn_blocks: dict[tuple[str, int], int] = {}
    import json

    for worker, raw in stream.dynamo_events():
        event = json.loads(raw)
        key = (fleet_instance_id(worker), event["dp_rank"])
        data = event["data"]
        if "stored" in data:
            dyn_blocks[key] = dyn_blocks.get(key, 0) + len(data["stored"]["blocks"])
        else:
            dyn_blocks[key] = dyn_blocks.get(key, 0) - len(data["removed"]["block_hashes"])
    assert sum(dyn_blocks.values()) == sum(len(s) for s in naive.held.values())
    hits = 0
    for size in (1, 64, 512):
        for engine, local in make_fleet_queries(stream.paths, size, 50, seed=size):
            assert len(engine) == len(local) == size
            expected = answers(index, engine)
            assert naive.find_matches(engine) == expected
            hits += bool(expected)
    assert hits >= 75  # at least the held-prefix half of the queries match


@pytest.mark.slow
def test_bench_index_runs_its_matrix_and_big_scale_end_to_end(tmp_path: Path) -> None:
    """A tiny run of bench/index.py (matrix, big scale, growth; Dynamo included): it must
    finish, write its JSON, and find every side answering alike; no timing is asserted."""
    import json
    import subprocess

    out = tmp_path / "index.json"
    script = Path(__file__).resolve().parents[3] / "bench" / "index.py"
    args = [
        "--quick",
        "--parts",
        "matrix,big,growth",
        "--matrix-workers",
        "16",
        "--matrix-worker-blocks",
        "4096",
    ]
    args += ["--big-workers", "16", "--big-blocks-per-worker", "1000", "--big-tail-instances", "1"]
    args += ["--growth-prefill", "20000", "--growth-window", "20000"]
    proc = subprocess.run(
        [sys.executable, str(script), *args, "--output", str(out)],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    cell = result["matrix"]["cells"]["16"]
    assert set(cell["sides"]) == {"kvevents", "dynamo", "naive"}
    for who in ("dynamo", "naive"):
        assert cell["cross_check"][who]["identical_answers"] == cell["cross_check"]["queries"] > 0
    floor = cell["floor_64"]  # the matrix's query floor, as the realistic stream's
    assert set(floor) == {"find_matches", "read_query_ints", "copy_answer_sized_dict"}
    assert all(f["p99_us"] >= f["p50_us"] > 0 for f in floor.values())
    assert "its parts that do not depend on the walk" in proc.stdout
    assert result["big_scale"]["memory"]["held_worker_blocks"] > 0
    one, both = result["big_scale"]["ingest"], result["big_scale"]["ingest_both_cores"]
    assert (one["ingest_threads"], both["ingest_threads"]) == (1, 2)  # issue 17 (b): both cores
    assert both["blocks"] == one["blocks"] > 0 and both["blocks_per_s"] > 0
    rows = {t["target"] for t in result["targets"]}
    assert {"ingest blocks/s (Avro bytes), one thread", "ingest blocks/s (Avro bytes), both cores"} <= rows
    restart = result["big_scale"]["worker_restart"]
    restarts = [r for r in restart["runs"] + restart["resets"]["kvevents"] if r["blocks_dropped"]]
    assert restarts  # (with 2 instances the middle one and the last are one: restarted twice)
    for run in restarts:  # Created and reset_worker: the blocks found before the lock (or, for a
        # cache under its list's limit, from that list), not by a scan under it
        assert run["clears_planned"] + run["clears_listed"] == 1 and run["clears_scanned"] == 0, run
    assert restart["to_bytes"]["kvevents"]["ms"] > 0  # a checkpoint's export, lookups running
    grown = result["growth"]["sides"]["kvevents"]["runs"][0]
    assert grown["table_growths"] >= 1 and grown["rebuilds_locked"] == 0, grown  # rebuilt ahead
    assert grown["lookups"] > 0
    assert {t["verdict"] for t in result["targets"]} <= {"PASS", "FAIL"}
    assert "issue 17 targets" in proc.stdout


def test_bench_feeds_apply_encoded_many_only_when_cache_index_has_it(monkeypatch: pytest.MonkeyPatch) -> None:
    from index_sides import ingest_method, ingest_ours

    stream = generate_fleet(FleetConfig(workers=8, blocks_per_worker=200, seed=4), dynamo=False)
    assert ingest_method() == (
        "apply_encoded_many" if hasattr(CacheIndex, "apply_encoded_many") else "apply_encoded"
    )
    calls: list[int] = []

    def many(self: CacheIndex, batches: list[bytes]) -> None:
        calls.append(len(batches))
        for data in batches:
            self.apply_encoded(data)

    monkeypatch.setattr(CacheIndex, "apply_encoded_many", many, raising=False)
    index = CacheIndex()
    ingest_ours(index, stream.batches)
    assert ingest_method() == "apply_encoded_many"
    assert calls == [len(stream.batches)]
    assert index.held_blocks() == stream.held_worker_blocks


def test_query_floor_times_find_matches_and_what_no_index_escapes() -> None:
    """``index_sides.query_floor``: find_matches, reading the query's ints and copying a
    dict of the answer's size, each after the other sides' calls on the previous query."""
    from index_realistic import make_queries
    from index_sides import query_floor

    stream = generate(StreamConfig(target_events=400, seed=3))
    index = CacheIndex()
    for b in stream.batches:
        index.apply_encoded(encode_batch(b))
    engine = [q[0] for q in make_queries(stream, 8, 20, seed=5)]
    calls: list[int] = []
    floor = query_floor(index, [(calls.append, list(range(len(engine))))], engine, repeat=2)
    assert set(floor) == {"find_matches", "read_query_ints", "copy_answer_sized_dict"}
    assert all(f["p50_us"] > 0 and f["p99_us"] >= f["p50_us"] for f in floor.values())
    assert len(calls) == 3 * 2 * len(engine)  # the other side ran before every timed call
