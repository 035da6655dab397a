"""The cache report on a hand-made stream whose answers are known: routing hits per policy,
evictions per tier, drops and gaps turned into degraded time healed by a Created event; the
rendering (text, PNG, HTML); and a stream rebuilt from rows giving the same report."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from kvevents.schemas import (
    EventBatch,
    KVCacheCreatedData,
    KVCacheEvent,
    KVCacheEventDiff,
    KVCacheRemovedData,
    KVCacheStoredBlockData,
    KVCacheStoredData,
    KVCacheUpdatedData,
    LimitError,
    RankDrops,
)

from kvevents.analytics.report import CacheReport
from kvevents.analytics.report_render import render_html, render_png, render_text
from kvevents.analytics.rows import RowBuffer
from kvevents.analytics.source import Read, batches_from_table
from kvevents.cli import main

S = 1_000_000
W = 64


def _stored(eid: int, parent: int | None, hashes: list[int]) -> KVCacheEvent:
    return KVCacheEvent(
        eid, KVCacheStoredData(parent, [KVCacheStoredBlockData(h, [1] * 4) for h in hashes]), W, 0
    )


def _stream() -> list[Read]:
    seq = {"a": 0, "b": 0}
    reads: list[Read] = []

    def batch(
        instance: str,
        t: float,
        events: list[KVCacheEvent],
        *,
        skip: int = 0,
        dropped: list[RankDrops] | None = None,
    ) -> None:
        seq[instance] += skip
        time_us = int((1000 + t) * S)
        b = EventBatch(
            instance,
            events,
            producer_id=1,
            sequence=seq[instance],
            created_at_us=time_us,
            dropped=dropped or [],
        )
        seq[instance] += 1
        reads.append(Read(b, time_us, 0, len(reads)))

    created = KVCacheCreatedData([16, 16])
    batch("a", 0, [KVCacheEvent(0, created, W, 0)])
    batch("b", 0, [KVCacheEvent(0, created, W, 0)])
    batch("a", 1, [_stored(1, None, [1, 2, 3])])  # nobody holds anything: 0 hits of 3
    batch("b", 2, [_stored(1, 2, [4])])  # chain 1,2,4: a holds 2 leading blocks, b none
    batch("a", 3, [KVCacheEvent(2, KVCacheUpdatedData(3, cache_level=KVCacheEventDiff(0, 1)), W, 0)])
    batch("a", 4, [KVCacheEvent(3, KVCacheRemovedData([3, 1, 99]), W, 0)])
    batch("b", 5, [], dropped=[RankDrops(0, 4)])  # b loses events: degraded from t=5
    batch("a", 6, [KVCacheEvent(4, KVCacheRemovedData([2]), W, 0)], skip=2)  # two batches of a missing
    batch("b", 8, [KVCacheEvent(5, KVCacheCreatedData([16, 16], snapshot=True), W, 0)])  # b rebuilt at t=8
    batch("a", 9, [_stored(5, None, [7])])
    return reads


def test_known_answers() -> None:
    report = CacheReport().add_all(_stream()).to_json()
    routing = report["routing"]
    assert routing["requests_scored"] == 3 and routing["chain_blocks"] == 3 + 3 + 1
    assert routing["hit_rate"] == {
        "cache_aware": round(2 / 7, 4),
        "round_robin": round(1 / 7, 4),
        "observed": 0.0,
    }
    assert report["tiers"]["evictions"] == {"primary (GPU)": 2, "secondary (host)": 1, "unknown": 1}
    assert report["tiers"]["offloads_primary_to_secondary"] == 1
    loss = report["loss"]
    assert loss["dropped_events"] == 4 and loss["missing_batches"] == 2
    a, b = loss["by_worker"]["a/0"], loss["by_worker"]["b/0"]
    assert b == {
        "dropped_events": 4,
        "degraded_spells": 1,
        "degraded_s": 3.0,
        "degraded_share": round(3 / 9, 4),
        "degraded_now": False,
    }
    assert (
        a["degraded_spells"] == 1 and a["degraded_s"] == 3.0 and a["degraded_now"] is True
    )  # t=6 to the end (t=9)
    assert report["block_lifetimes"]["count"] == 3  # 3 and 1 at t=4, 2 at t=6 (99 was never stored)


def test_rows_rebuild_the_same_report() -> None:
    reads = _stream()
    rows = RowBuffer()
    instances: list[str] = []
    for r in reads:
        added = rows.add_batch(r.batch, r.partition, r.offset, r.time_us)
        instances += [r.batch.instance_id] * added  # in an export, the directory names say it
    table = rows.table().append_column("instance", pa.array(instances, pa.string()))
    rebuilt = list(batches_from_table(table))
    assert [r.offset for r in rebuilt] == [r.offset for r in reads if r.batch.events or r.batch.dropped]
    assert CacheReport().add_all(rebuilt).to_json() == CacheReport().add_all(reads).to_json()


def test_rendering() -> None:
    cache = CacheReport().add_all(_stream())
    report = cache.to_json()
    text = "\n".join(render_text(report))
    assert "cache-aware router" in text and "28.6%" in text and "b/0" in text
    png = render_png(cache, report, "test")
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 10_000
    page = render_html(report, png, "a <title>")
    assert page.count("<table>") == 6 and "a &lt;title&gt;" in page and "data:image/png;base64," in page


def _random_fleet_stream(seed: int, batches: int) -> list[Read]:
    """Three instances of up to four ranks: Stored chains, Removed, Created (snapshot or not),
    skipped sequences and event ids, drops of ranks that sent nothing, producer restarts."""
    rng = random.Random(seed)
    seq: dict[str, int] = {}
    producer: dict[str, int] = {}
    next_id: dict[tuple[str, int], int] = {}
    held: dict[tuple[str, int], list[int]] = {}
    reads: list[Read] = []
    for n in range(batches):
        instance = rng.choice("abc")
        if rng.random() < 0.03:
            producer[instance] = producer.get(instance, 0) + 1
            seq[instance] = 0
        seq[instance] = seq.get(instance, 0) + (rng.random() < 0.05)  # a lost batch now and then
        events = []
        for _ in range(rng.randrange(4)):
            rank = rng.randrange(4)
            key = (instance, rank)
            eid = next_id.get(key, 0) + (rng.random() < 0.03)  # a lost event now and then
            next_id[key] = eid + 1
            blocks = held.setdefault(key, [])
            roll = rng.random()
            if roll < 0.1:
                blocks.clear()
                data: object = KVCacheCreatedData([16, 16], snapshot=rng.random() < 0.5)
            elif roll < 0.3 and blocks:
                gone = [blocks.pop(rng.randrange(len(blocks))) for _ in range(min(2, len(blocks)))]
                data = KVCacheRemovedData(gone)
            else:
                parent = rng.choice(blocks) if blocks and rng.random() < 0.5 else None
                hashes = [rng.randrange(1, 200) for _ in range(rng.randrange(1, 4))]
                blocks.extend(hashes)
                data = KVCacheStoredData(parent, [KVCacheStoredBlockData(h, [1] * 4) for h in hashes])
            events.append(KVCacheEvent(eid, data, W, rank))  # type: ignore[arg-type]
        dropped = [RankDrops(rng.randrange(4), 3)] if rng.random() < 0.05 else []
        time_us = (1000 + n) * S
        b = EventBatch(
            instance,
            events,
            attention_dp_size=4,
            producer_id=producer.get(instance, 0),
            sequence=seq[instance],
            created_at_us=time_us,
            dropped=dropped,
        )
        seq[instance] += 1
        reads.append(Read(b, time_us, 0, n))
    return reads


def test_degraded_spells_and_workers_follow_the_index_on_a_lossy_fleet() -> None:
    """The report looks only at the ranks a batch names (all of its instance's after a gap): it
    must still see every degraded worker the index sees, after every batch, and count the
    index's workers for round-robin."""
    for seed in range(5):
        report = CacheReport()
        spells = 0
        for read in _random_fleet_stream(seed, 400):
            report.add(read)
            degraded = set(report.index.degraded_workers())
            assert set(report._degraded_since) == degraded, (seed, read.offset)
            assert report.index.worker_count() == len(report.index.workers())
            spells = sum(report.degraded_spells.values())
        assert spells > 3 and report.routing.requests > 100  # the stream did degrade and heal


def test_created_ends_only_its_own_workers_blocks() -> None:
    """A Created event ends the lifetimes and tier records of its own worker's blocks, no
    other's (both kept per worker, so a Created costs its worker's blocks, not the fleet's)."""
    report = CacheReport()
    for k in range(50):
        b = EventBatch(f"w{k}", [_stored(0, None, [k * 10 + j for j in range(1, 5)])], created_at_us=1000 * S)
        report.add(Read(b, 1000 * S, 0, k))
    for k in range(0, 50, 2):
        b = EventBatch(f"w{k}", [KVCacheEvent(1, KVCacheCreatedData([16]), W, 0)], sequence=1)
        report.add(Read(b, 1001 * S, 0, 50 + k))
    summary = report.to_json()
    assert report.stats.ended_by_created == 25 * 4
    assert summary["block_lifetimes"]["still_held"] == 25 * 4
    assert sum(len(levels) for levels in report._levels.values()) == 25 * 4
    b = EventBatch("w1", [KVCacheEvent(1, KVCacheRemovedData([11, 12]), W, 0)], sequence=1)
    report.add(Read(b, 1002 * S, 0, 200))
    assert report.evictions == {"primary (GPU)": 2}


def test_a_batch_the_index_refuses_is_set_aside_not_the_end_of_the_report(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A batch that decodes but breaks the index's limits (here a rank outside
    attention_dp_size) used to stop ``CacheReport.add`` midway and ``kvevents report`` with a
    traceback. It is refused before anything is counted, and the command sets it aside."""
    reads = _stream()
    event = KVCacheEvent(9, KVCacheStoredData(None, [KVCacheStoredBlockData(77, [1] * 4)]), W, 5)
    bad = EventBatch("b", [event], attention_dp_size=1, sequence=99, created_at_us=(1000 + 5) * S)
    report = CacheReport()
    with pytest.raises(LimitError, match=r"attention_dp_rank: 5 is not in 0\.\.0"):
        report.add(Read(bad, bad.created_at_us, 0, 999))
    assert report.stats.batches == 0 and report.index.stats().workers == 0

    by_instance: dict[str, RowBuffer] = {}
    for r in [*reads[:6], Read(bad, bad.created_at_us, 0, 6), *reads[6:]]:
        by_instance.setdefault(r.batch.instance_id, RowBuffer()).add_batch(
            r.batch, r.partition, r.offset, r.time_us
        )
    for instance, rows in by_instance.items():  # an export's layout: a folder per instance
        folder = tmp_path / "export" / "date=2026-12-07" / f"instance={instance}"
        folder.mkdir(parents=True)
        pq.write_table(rows.table(), folder / "part-0.parquet")
    assert main(["report", "--parquet", str(tmp_path / "export"), "--json", "-q"]) == 0
    out, err = capsys.readouterr()
    assert "attention_dp_rank: 5 is not in 0..0" in err
    summary = json.loads(out)
    assert summary["loss"]["malformed_messages"] == 1
    assert summary["routing"] == CacheReport().add_all(reads).to_json()["routing"]  # the rest is read
