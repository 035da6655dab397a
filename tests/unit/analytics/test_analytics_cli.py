"""The analytics commands fail with one line naming the problem: no pyspark, no export
directory, an empty one, an export of another topic."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from kvevents.cli import main


def test_export_spark_without_pyspark(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    monkeypatch.setitem(sys.modules, "pyspark", None)  # import pyspark -> ImportError
    assert main(["export", "spark", str(tmp_path), "-b", "127.0.0.1:1"]) == 2
    assert capsys.readouterr().err.strip() == (
        "kvevents export spark: pyspark is missing: install the spark extra (pip install 'kvevents[spark]')"
    )


@pytest.mark.parametrize(("make", "message"), [(False, "not a directory"), (True, "no Parquet files")])
def test_report_on_a_missing_or_empty_directory(
    make: bool, message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    target = tmp_path / "events"
    if make:
        target.mkdir()
    assert main(["report", "--parquet", str(target)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("kvevents report: ") and message in err and err.count("\n") == 1


def test_export_into_another_topics_directory(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from kvevents.analytics.parquet_sink import ExportState

    ExportState("topic-a").save(tmp_path)
    assert main(["export", "parquet", str(tmp_path), "-t", "topic-b", "-b", "127.0.0.1:1"]) == 1
    assert "holds an export of topic 'topic-a', not 'topic-b'" in capsys.readouterr().err


def test_help_texts() -> None:
    for command in (["export", "parquet", "--help"], ["export", "spark", "--help"], ["report", "--help"]):
        with pytest.raises(SystemExit) as exit_info:
            main(command)
        assert exit_info.value.code == 0
