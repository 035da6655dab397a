"""``kvevents stats``: the analytics over hand-made batches, range parsing, the text report."""

from __future__ import annotations

import datetime as dt

import pytest
from cli_events import batch, created, removed, stored, updated

from kvevents.commands._stats import StreamStats, percentile
from kvevents.commands.stats import auto_bucket, parse_bound, render

S = 1_000_000  # one second in microseconds
T0 = 1_700_000_000 * S


def test_rates_and_buckets_by_type() -> None:
    stats = StreamStats(bucket_s=1.0)
    stats.add(batch([created(0), stored(1, [1, 2])], 0), T0)
    stats.add(batch([stored(2, [3], parent=2), removed(3, [3])], 1), T0 + S // 2)
    stats.add(batch([updated(4, 1, level=(0, 1))], 2), T0 + 4 * S)
    report = stats.to_json()
    assert report["events"] == {"created": 1, "stored": 2, "removed": 1, "updated": 1}
    assert report["rates_per_s"] == {"created": 0.25, "stored": 0.5, "removed": 0.25, "updated": 0.25}
    times, rates = stats.series()
    assert times == [0.0, 1.0, 2.0, 3.0, 4.0]
    assert rates["stored"] == [2.0, 0, 0, 0, 0] and rates["updated"] == [0, 0, 0, 0, 1.0]


def test_level_moves_and_priority_changes() -> None:
    stats = StreamStats()
    stats.add(
        batch([stored(0, [1, 2]), updated(1, 1, level=(0, 1)), updated(2, 2, level=(0, 1)),
               updated(3, 1, level=(1, 0), priority=(35, 80)), updated(4, 2, priority=(35, 35)),
               updated(5, 2, level=(1, 2))], 0),
        T0,
    )  # fmt: skip
    moves = stats.to_json()["level_moves"]
    assert (moves["primary_to_secondary"], moves["secondary_to_primary"], moves["priority_changes"]) == (
        2,
        1,
        1,
    )
    assert moves["all"] == {"0->1": 2, "1->0": 1, "1->2": 1}


def test_block_lifetimes_per_worker_and_window() -> None:
    stats = StreamStats()
    stats.add(batch([stored(0, [1, 2, 3]), stored(0, [1], rank=1)], 0), T0)
    stats.add(batch([removed(1, [1])], 1), T0 + 2 * S)  # rank 0's block 1: 2 s
    stats.add(batch([removed(2, [2, 99])], 2), T0 + 6 * S)  # block 2: 6 s; 99 never stored in range
    stats.add(batch([created(1, rank=1)], 3), T0 + 7 * S)  # ends rank 1's block 1 without a lifetime
    life = stats.to_json()["block_lifetimes"]
    assert life["count"] == 2 and life["p50_s"] == 4.0 and life["max_s"] == 6.0
    assert life["removed_without_store_in_range"] == 1
    assert life["ended_by_created"] == 1 and life["still_held"] == 1  # rank 0's block 3


def test_prefix_reuse_across_workers() -> None:
    stats = StreamStats()
    stats.add(batch([stored(0, [1, 2], rank=0)], 0), T0)
    stats.add(batch([stored(0, [1, 2, 5], rank=1)], 1), T0)  # two blocks rank 0 already stored
    stats.add(batch([stored(1, [6], parent=2, rank=1)], 2), T0)  # parent stored by rank 0 (and 1)
    stats.add(batch([stored(1, [7], parent=1, rank=0)], 3), T0)  # parent stored by rank 1 too
    stats.add(batch([stored(2, [1], rank=0)], 4), T0)  # stored again by rank 0; rank 1 has it too
    stats.add(batch([stored(0, [9], parent=9, rank=0)], 0, instance="solo"), T0)
    reuse = stats.to_json()["prefix_reuse"]
    assert reuse["stored_blocks"] == 9
    assert reuse["already_stored_by_another_worker"] == 3  # 1 and 2 by rank 1, then 1 by rank 0
    assert reuse["stored_events_with_parent"] == 3 and reuse["parent_stored_by_another_worker"] == 2
    assert reuse["share"] == round(3 / 9, 4)


def test_drops_sequence_gaps_event_id_gaps_and_replays() -> None:
    stats = StreamStats()
    stats.add(batch([stored(0, [1]), stored(0, [2], rank=1)], 0), T0)
    stats.add(batch([stored(4, [3])], 1, dropped=[(0, 3)]), T0)  # ids 1..3 of rank 0 lost, reported
    stats.add(batch([stored(4, [3])], 1, dropped=[(0, 3)]), T0)  # the same batch again: a replay
    stats.add(batch([stored(9, [4], rank=1)], 5), T0)  # batches 2..4 missing; rank 1 skipped 1..8
    stats.add(batch([stored(0, [5])], 0, instance="other", pid=1), T0)
    stats.add(batch([stored(1, [6])], 0, instance="other", pid=2), T0)  # a new producer session
    gaps = stats.to_json()["drops_and_gaps"]
    assert gaps["dropped_events"] == 3 and gaps["dropped_by_worker"] == {"i0/0": 3}
    assert gaps["missing_batches"] == 3 and gaps["missing_batches_by_instance"] == {"i0": 3}
    assert gaps["event_ids_skipped_by_worker"] == {"i0/0": 3, "i0/1": 8}
    assert gaps["replayed_batches"] == 1 and gaps["replayed_events"] == 1
    assert gaps["producer_changes"] == {"other": 1}
    assert stats.to_json()["events"]["stored"] == 6  # 2 + 1 + (replay skipped) + 1 + 2


def test_percentile_interpolates() -> None:
    assert percentile([], 50) == 0.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile([1.0, 2.0, 3.0, 4.0], 100) == 4.0
    assert percentile([5.0], 99) == 5.0


def test_range_bounds() -> None:
    assert parse_bound("1500").offset == 1500
    now = 1_000_000.0
    assert parse_bound("10m", now=now).time_us == int((now - 600) * 1e6)
    assert parse_bound("1.5h", now=now).time_us == int((now - 5400) * 1e6)
    assert parse_bound("2026-12-02T15:30:00Z").time_us == int(
        dt.datetime(2026, 12, 2, 15, 30, tzinfo=dt.UTC).timestamp() * 1e6
    )
    assert parse_bound("2026-12-02T15:30:00+01:00").time_us == int(
        dt.datetime(2026, 12, 2, 14, 30, tzinfo=dt.UTC).timestamp() * 1e6
    )
    with pytest.raises(ValueError, match="not a time or an offset"):
        parse_bound("yesterday")


def test_auto_bucket_is_a_round_step_near_a_sixtieth() -> None:
    assert auto_bucket(600) == 10
    assert auto_bucket(30) == 0.5
    assert auto_bucket(0.043) == 0.001
    assert auto_bucket(7200) == 200


def test_text_report_names_every_section() -> None:
    stats = StreamStats()
    stats.add(batch([created(0), stored(1, [1]), removed(2, [1])], 0, dropped=[(1, 4)]), T0)
    report = {**stats.to_json(), "topic": "t", "interrupted": False}
    text = "\n".join(render(report))
    for part in (
        "event type",
        "cache-level moves",
        "block lifetimes",
        "prefix reuse",
        "4 events dropped in-band",
        "i0/1 4",
    ):
        assert part in text, part


def test_until_bounds_by_offset_or_time() -> None:
    from kvevents.commands.stats import Bound, _in_range

    assert _in_range(None, 10**9, T0)
    assert _in_range(Bound(offset=5), 4, T0) and not _in_range(Bound(offset=5), 5, T0)
    assert _in_range(Bound(time_us=T0 + 1), 0, T0) and not _in_range(Bound(time_us=T0), 0, T0)
    assert _in_range(Bound(time_us=T0), 0, 0)  # a batch without any time is kept


def test_plot_without_matplotlib_fails_clearly_before_reading(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import sys

    from kvevents.cli import main

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    code = main(["stats", "-b", "127.0.0.1:1", "--plot", "x.png"])
    assert code == 2
    assert "pip install 'kvevents[cli]'" in capsys.readouterr().err


def test_a_huge_span_is_drawn_in_coarser_buckets_not_one_point_each() -> None:
    """Two batches 2**44 us apart with a 1 s bucket made 17.6M points (45 s, 3.7 GB)."""
    from kvevents.commands._stats import MAX_SERIES_POINTS

    stats = StreamStats(bucket_s=1.0)
    stats.add(batch([created(0)], 0), 1)
    stats.add(batch([created(1), created(2)], 1), 2**44)
    times, rates = stats.series()
    step = stats.series_step()
    assert len(times) <= MAX_SERIES_POINTS and step == -(-((2**44 // 10**6) + 1) // MAX_SERIES_POINTS)
    assert times[1] == step * 1.0
    assert sum(r * step for r in rates["created"]) == 3  # every event still counted
    small = StreamStats(bucket_s=1.0)
    small.add(batch([created(0)], 0), 1)
    small.add(batch([created(1)], 1), 5_000_001)
    assert small.series_step() == 1 and len(small.series()[0]) == 6
