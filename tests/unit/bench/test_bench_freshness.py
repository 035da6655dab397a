"""``bench/freshness.py`` (``support/freshness_stages.py``) splits an event's path into stages from real Avro bytes and flush logs:
each stage is the difference of the right two stamps, the events of a step's first seconds (the
producer starting) are left out of the latencies but kept in ``e2e_all``, and the cores a step
used are split into the ranks, the consumer and the rest."""

from __future__ import annotations

import json
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from kvevents.schemas import EventBatch, KVCacheEvent, KVCacheRemovedData, encode_batch

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "bench"))
sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "bench" / "support"))

import freshness
import freshness_stages


class FakeTail:
    """What ``stage_latencies`` reads of a ``Tail``: the sampled messages."""

    def __init__(self, samples: list[tuple[bytes, int, float, float]]) -> None:
        self.samples = samples


def message(events: list[tuple[int, int]], created_s: float) -> bytes:
    """A batch of Removed events (event id, attention-DP rank) built at ``created_s`` (wall clock)."""
    return encode_batch(
        EventBatch(
            "inst",
            [KVCacheEvent(i, KVCacheRemovedData([i]), 16, rank) for i, rank in events],
            attention_dp_size=2,
            created_at_us=int(created_s * 1e6),
        )
    )


def write_flushes(directory: Path, rank: int, flushes: list[tuple[int, float]]) -> None:
    log = {"instance_id": "inst", "attention_dp_rank": rank, "flushes": [list(f) for f in flushes]}
    (directory / f"flush-inst-{rank}.json").write_text(json.dumps(log))


def test_each_stage_is_the_gap_between_its_two_stamps(tmp_path: Path) -> None:
    offset = 1000.0  # wall = monotonic + offset
    write_flushes(tmp_path, 0, [(1, 10.0), (3, 12.0)])
    write_flushes(tmp_path, 1, [(2, 10.5)])
    # rank 0's events 0-1 flushed at 10.0 and rank 1's event 2 at 10.5: built 10.6, appended 10.7,
    # handed 10.75, applied 10.76 (monotonic); rank 0's event 3 (flushed 12.0) applied at 12.5
    first = message([(0, 0), (1, 0), (2, 1)], 10.6 + offset)
    second = message([(3, 0)], 12.2 + offset)
    tail = FakeTail(
        [
            (first, round((10.7 + offset) * 1000), 10.75, 10.76),
            (second, round((12.3 + offset) * 1000), 12.4, 12.5),
        ]
    )
    out = freshness_stages.stage_latencies(tail, tmp_path, offset)  # type: ignore[arg-type]
    assert out["e2e"] == pytest.approx([0.76, 0.76, 0.26, 0.5])
    assert out["e2e_all"] == out["e2e"]
    assert out["sink"] == pytest.approx([0.6, 0.6, 0.2])
    assert out["gather_sink"] == pytest.approx([0.1])
    assert out["produce"] == pytest.approx([0.1, 0.1, 0.1, 0.1], abs=1e-3)
    assert out["fetch"] == pytest.approx([0.05, 0.05, 0.05, 0.1], abs=1e-3)
    assert out["apply"] == pytest.approx([0.01, 0.01, 0.01, 0.1])

    settled = freshness_stages.stage_latencies(tail, tmp_path, offset, settle_s=1.0)  # type: ignore[arg-type]
    assert settled["e2e"] == pytest.approx([0.5])  # only the event flushed 2 s after the first flush
    assert settled["sink"] == pytest.approx([0.2])
    assert settled["gather_sink"] == []
    assert settled["e2e_all"] == pytest.approx([0.76, 0.76, 0.26, 0.5])


def test_an_event_without_a_flush_record_is_left_out(tmp_path: Path) -> None:
    write_flushes(tmp_path, 0, [(1, 10.0)])
    tail = FakeTail([(message([(5, 0)], 10.5), 10_600, 10.7, 10.8)])
    out = freshness_stages.stage_latencies(tail, tmp_path, 0.0)  # type: ignore[arg-type]
    assert out["e2e"] == [] and out["e2e_all"] == []


def test_cores_are_split_into_ranks_consumer_and_the_rest(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(freshness_stages.os, "cpu_count", lambda: 2)
    # 600 of 1000 jiffies busy over all CPUs = 1.2 of 2 cores; ranks 4 s and consumer 1 s of CPU in 10 s
    report: dict[str, Any] = freshness_stages.cpu_report(((100, 1000), (700, 2000)), 4.0, 1.0, 10.0)
    assert report == {
        "cores": 2,
        "machine_cores_busy": 1.2,
        "ranks_cores": 0.4,
        "consumer_cores": 0.1,
        "other_cores": 0.7,
    }
    assert freshness_stages.cpu_report(((0, 0), (0, 0)), 1.0, 0.0, 1.0)["machine_cores_busy"] is None


def test_the_machine_counters_read_from_proc() -> None:
    busy, total = freshness_stages.cpu_ticks()
    if Path("/proc/stat").exists():
        assert 0 < busy <= total


def test_try_simulate_gives_a_variant_its_own_engine_flags(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """``--try-simulate NAME:FLAGS``: a variant run with the defaults' producer settings whose
    ranks get the extra ``kvevents simulate`` flags; the other variants get none."""
    seen: dict[str, Any] = {}

    def fake_measure(*args: Any, **kwargs: Any) -> dict[str, Any]:
        seen.update(kwargs)
        return {"variants": {}, "kafka": None, "loadavg_start": (0, 0, 0), "loadavg_end": (0, 0, 0)}

    monkeypatch.setattr(freshness, "measure", fake_measure)
    out = tmp_path / "f.json"
    argv = ["--rates", "640", "--try-simulate", "slack0:--pace-slack-ms 0", "--output", str(out)]
    assert freshness.main(argv) == 0
    assert list(seen["variants"]) == ["defaults", "slack0"]
    assert seen["variants"]["slack0"] == ({}, {})
    assert seen["simulate_args"] == {"slack0": ["--pace-slack-ms", "0"]}
    with pytest.raises(SystemExit):
        freshness.main(["--try-simulate", "defaults:--pace-slack-ms 0", "--output", str(out)])


def test_broker_gc_counts_the_pauses_of_the_step_and_the_slow_samples_they_held(tmp_path: Path) -> None:
    offset = 1_800_000_000.0  # wall = monotonic + offset
    log = tmp_path / "gc.log"
    stamp = "[2027-01-15T08:00:{:06.3f}+0000] GC({}) Pause Young (Allocation Failure) 250M->157M(365M) {}ms"
    start = datetime(2027, 1, 15, 8, 0, 0, tzinfo=UTC).timestamp()
    log.write_text(
        "\n".join(
            [
                stamp.format(5.050, 0, "50.000"),  # 5.000-5.050 s: inside the step
                stamp.format(30.000, 1, "40.000"),  # after the step
            ]
        )
        + "\n"
    )
    mono = start - offset  # the minute's start on the monotonic clock
    # 200 produce spans of 1 ms over 4..8 s; the 2 slowest (of 200: the slowest 1%) straddle the pause
    spans = [(mono + 4.0 + i * 0.02, mono + 4.0 + i * 0.02 + 0.001) for i in range(200)]
    spans[10] = (mono + 4.99, mono + 5.06)
    spans[11] = (mono + 5.0, mono + 5.055)
    report = freshness_stages.broker_gc(log, spans, offset)
    assert report == {
        "pauses": 1,
        "max_ms": 50.0,
        "longest_kind": "Pause Young",
        "total_ms": 50.0,
        "slowest_produce_in_pause": 1.0,
    }
    spans[11] = (mono + 6.0, mono + 6.08)  # the second slowest no longer overlaps the pause
    assert freshness_stages.broker_gc(log, spans, offset)["slowest_produce_in_pause"] == 0.5  # type: ignore[index]
    assert freshness_stages.broker_gc(None, spans, offset) is None, "an unknown log reports nothing"
