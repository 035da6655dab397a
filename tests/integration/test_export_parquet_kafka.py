"""``kvevents export parquet`` against the real broker: every event of a simulated stream (two
instances of two attention-DP ranks) lands as rows exactly once, a malformed message is
counted and listed, a re-run appends only what is new, and a run killed (SIGKILL) mid-export
then restarted leaves exactly the rows of a clean run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pyarrow.dataset as ds
import pytest
from cli_streams import simulate_to_topic
from kafka_streams import produce
from kvevents.schemas import (
    EventBatch,
    KVCacheCreatedData,
    KVCacheRemovedData,
    KVCacheStoredData,
    KVCacheUpdatedData,
)

from kvevents.cli import main

pytestmark = pytest.mark.kafka

_KEY = ("instance", "attention_dp_rank", "event_id", "event_type", "block_hash")


def expected_rows(batches: list[EventBatch]) -> Counter[tuple[object, ...]]:
    """Per (instance, rank, event id, type, unsigned hash) how many rows the batches make."""
    rows: Counter[tuple[object, ...]] = Counter()
    for b in batches:
        for d in b.dropped:
            rows[(b.instance_id, d.attention_dp_rank, None, "dropped", None)] += 1
        for e in b.events:
            key = (b.instance_id, e.attention_dp_rank, e.event_id)
            if isinstance(e.data, KVCacheStoredData):
                for block in e.data.blocks:
                    rows[(*key, "stored", block.block_hash)] += 1
            elif isinstance(e.data, KVCacheRemovedData):
                for h in e.data.block_hashes:
                    rows[(*key, "removed", h)] += 1
            elif isinstance(e.data, KVCacheUpdatedData):
                rows[(*key, "updated", e.data.block_hash)] += 1
            elif isinstance(e.data, KVCacheCreatedData):
                rows[(*key, "created", None)] += 1
    return rows


def exported_rows(out: Path) -> Counter[tuple[object, ...]]:
    table = ds.dataset(out, format="parquet", partitioning="hive").to_table()
    rows: Counter[tuple[object, ...]] = Counter()
    for r in table.select(list(_KEY)).to_pylist():
        h = r["block_hash"]
        rows[
            (
                r["instance"],
                r["attention_dp_rank"],
                r["event_id"],
                r["event_type"],
                None if h is None else h % (1 << 64),
            )
        ] += 1
    return rows


def _export(bootstrap: str, topic: str, out: Path, *extra: str) -> dict[str, object]:
    args = ["export", "parquet", str(out), "-b", bootstrap, "-t", topic, "--json", "-q", *extra]
    return _run_main(args)


def _run_main(args: list[str]) -> dict[str, object]:
    from contextlib import redirect_stdout
    from io import StringIO

    buf = StringIO()
    with redirect_stdout(buf):
        assert main(args) == 0
    return json.loads(buf.getvalue())


def test_export_every_event_once_and_resume(kafka_bootstrap: str, kafka_topic: str, tmp_path: Path) -> None:
    first = simulate_to_topic(kafka_bootstrap, kafka_topic, iterations=30)
    produce(kafka_bootstrap, kafka_topic, [(b"sim-a", b"\x00not avro")])
    out = tmp_path / "events"
    summary = _export(kafka_bootstrap, kafka_topic, out, "--rows-per-file", "500")
    want = expected_rows(first.sent)
    assert summary["malformed"] == 1 and summary["rows"] == sum(want.values())
    assert exported_rows(out) == want
    dates = {p.name for p in out.iterdir() if p.is_dir()}
    assert len(dates) == 1 and dates.pop().startswith("date=")
    assert {p.name for p in next(p for p in out.iterdir() if p.is_dir()).iterdir()} == {
        "instance=sim-a",
        "instance=sim-b",
    }
    malformed = [json.loads(line) for line in (out / "_malformed.jsonl").read_text().splitlines()]
    assert [m["offset"] for m in malformed] == [len(first.sent)]

    assert _export(kafka_bootstrap, kafka_topic, out)["rows"] == 0  # nothing new: nothing written
    second = simulate_to_topic(kafka_bootstrap, kafka_topic, instances=("sim-c",), ranks=1, iterations=10)
    summary = _export(kafka_bootstrap, kafka_topic, out)
    assert summary["rows"] == sum(expected_rows(second.sent).values())
    assert exported_rows(out) == want + expected_rows(second.sent)


def test_killed_export_restarts_without_loss_or_duplicates(
    kafka_bootstrap: str, kafka_topic: str, tmp_path: Path
) -> None:
    produced = simulate_to_topic(kafka_bootstrap, kafka_topic, iterations=60)
    out = tmp_path / "events"
    command = [sys.executable, "-m", "kvevents.cli", "export", "parquet", str(out), "-b", kafka_bootstrap,
               "-t", kafka_topic, "--rows-per-file", "200", "--follow", "-q"]  # fmt: skip
    state = out / "_kvevents_export.json"
    kills = 0
    for _ in range(3):  # kill it a few times at whatever point it has reached
        proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        try:
            deadline = time.monotonic() + 60
            before = json.loads(state.read_text())["next_chunk"] if state.exists() else 0
            while time.monotonic() < deadline:
                if state.exists() and json.loads(state.read_text())["next_chunk"] > before:
                    break
                time.sleep(0.01)
            os.kill(proc.pid, signal.SIGKILL)
            kills += 1
        finally:
            proc.wait(timeout=30)
    assert kills == 3
    summary = _export(kafka_bootstrap, kafka_topic, out)
    assert summary["caught_up"] is True
    assert exported_rows(out) == expected_rows(produced.sent)


def test_report_from_topic_equals_report_from_export(
    kafka_bootstrap: str, kafka_topic: str, tmp_path: Path
) -> None:
    produced = simulate_to_topic(kafka_bootstrap, kafka_topic, iterations=30)
    produce(kafka_bootstrap, kafka_topic, [(b"sim-a", b"\x00not avro")])
    out = tmp_path / "events"
    _export(kafka_bootstrap, kafka_topic, out)
    png, page = tmp_path / "report.png", tmp_path / "report.html"
    from_topic = _run_main(
        [
            "report",
            "-b",
            kafka_bootstrap,
            "-t",
            kafka_topic,
            "--json",
            "-q",
            "--png",
            str(png),
            "--html",
            str(page),
        ]
    )
    from_parquet = _run_main(["report", "--parquet", str(out), "--json", "-q"])
    for report in (from_topic, from_parquet):
        for key in ("source", "png", "html"):
            report.pop(key, None)
    assert from_topic == from_parquet
    assert from_topic["events"]["stored"] == sum(
        1 for b in produced.sent for e in b.events if isinstance(e.data, KVCacheStoredData)
    )
    assert from_topic["loss"]["malformed_messages"] == 1
    assert sorted(from_topic["workers"]) == ["sim-a/0", "sim-a/1", "sim-b/0", "sim-b/1"]
    rates = from_topic["routing"]["hit_rate"]
    assert rates["cache_aware"] >= rates["observed"] and rates["cache_aware"] >= rates["round_robin"]
    assert png.read_bytes().startswith(b"\x89PNG") and "data:image/png;base64," in page.read_text()


def test_an_instance_id_too_long_for_a_folder_is_set_aside_and_the_export_goes_on(
    kafka_bootstrap: str, kafka_topic: str, tmp_path: Path
) -> None:
    """A valid 247-byte instance id makes a 256-byte partition folder name: the export stopped
    on OSError (File name too long) and, with no offsets saved, again at every restart."""
    from kvevents.schemas import KVCacheEvent, encode_batch

    long_id = "x" * 247
    batches = [
        EventBatch("ok", [KVCacheEvent(0, KVCacheRemovedData([1]), 0, 0)]),
        EventBatch(long_id, [KVCacheEvent(0, KVCacheRemovedData([2]), 0, 0)]),
        EventBatch("ok", [KVCacheEvent(1, KVCacheRemovedData([3]), 0, 0)], sequence=1),
    ]
    produce(kafka_bootstrap, kafka_topic, [(b.instance_id.encode(), encode_batch(b)) for b in batches])
    out = tmp_path / "events"
    summary = _export(kafka_bootstrap, kafka_topic, out)
    assert summary["malformed"] == 1 and summary["rows"] == 2
    assert exported_rows(out) == expected_rows([batches[0], batches[2]])
    [aside] = [json.loads(line) for line in (out / "_malformed.jsonl").read_text().splitlines()]
    assert aside["offset"] == 1 and "256-byte partition folder name" in aside["error"]
