"""The analytics' bounded memory (``kvevents.commands._bounded``): a reservoir exact up to its
capacity and a uniform, reproducible sample past it; a two-generation map that keeps recently
written keys and counts what it forgets; and ``stats`` reporting both over a long range."""

from __future__ import annotations

import statistics

import pytest
from cli_events import batch, removed, stored

from kvevents.commands import _stats
from kvevents.commands._bounded import RecentMap, Reservoir
from kvevents.commands._stats import StreamStats

S = 1_000_000
T0 = 1_700_000_000 * S


def test_the_reservoir_is_exact_up_to_its_capacity_then_a_uniform_sample() -> None:
    small = Reservoir(capacity=10)
    for v in (3.0, 1.0, 2.0):
        small.add(v)
    assert sorted(small) == [1.0, 2.0, 3.0] and not small.sampled and small.max == 3.0

    big = Reservoir(capacity=1_000)
    for v in range(100_000):
        big.add(float(v))
    assert big.count == 100_000 and len(big) == 1_000 and big.sampled
    assert big.max == 99_999.0 and big.total == sum(range(100_000))
    # a uniform sample of 0..99,999: its median near 50,000, its quartiles near 25k and 75k
    q1, median, q3 = statistics.quantiles(big, n=4)
    assert abs(median - 50_000) < 5_000 and abs(q1 - 25_000) < 5_000 and abs(q3 - 75_000) < 5_000
    again = Reservoir(capacity=1_000)
    for v in range(100_000):
        again.add(float(v))
    assert list(again) == list(big)  # seeded: the same stream, the same sample
    with pytest.raises(ValueError, match="capacity must be at least 1"):
        Reservoir(capacity=0)


def test_the_recent_map_keeps_two_generations_and_counts_what_it_forgets() -> None:
    recent: RecentMap[int, str] = RecentMap(generation=3)
    for k in range(3):
        recent[k] = f"v{k}"
    recent[3] = "v3"  # the first generation (0, 1, 2) becomes the previous one
    assert recent.get(0) == "v0" and 2 in recent and recent.forgotten == 0
    recent[0] = "again"  # written again: in the current generation now
    recent[4] = "v4"
    recent[5] = "v5"  # current (3, 0, 4) full: becomes previous; 1 and 2 are forgotten
    assert recent.forgotten == 2 and 1 not in recent and recent.get(2, "gone") == "gone"
    assert recent.get(0) == "again" and recent.get(3) == "v3" and len(recent) == 4


def test_stats_stays_bounded_and_says_so_over_a_long_range(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_stats, "LIFETIME_SAMPLE", 50)
    monkeypatch.setattr(_stats, "STORERS_GENERATION", 40)
    stats = StreamStats()
    for i in range(200):  # worker 0 stores block i at second i and removes block i - 1
        events = [stored(2 * i, [1000 + i])] + ([removed(2 * i + 1, [999 + i])] if i else [])
        stats.add(batch(events, i), T0 + i * S)
    stats.add(batch([stored(400, [1000])], 200, instance="other"), T0 + 201 * S)  # block 1000: forgotten
    stats.add(batch([stored(401, [1199])], 201, instance="other"), T0 + 202 * S)  # block 1199: recent
    report = stats.to_json()
    life = report["block_lifetimes"]
    assert life["count"] == 199 and life["percentiles_sampled"] is True
    assert life["max_s"] == life["mean_s"] == life["p50_s"] == 1.0
    reuse = report["prefix_reuse"]
    assert reuse["block_hashes_forgotten"] > 0
    assert reuse["already_stored_by_another_worker"] == 1  # 1199, not the forgotten 1000
