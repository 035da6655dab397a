"""The ``kvevents broker`` and ``kvevents topic`` commands where no broker is needed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvevents.cli import main


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["broker", "--help"], "KVEVENTS_CACHE_DIR"),
        (["broker", "start", "--help"], "--foreground"),
        (["broker", "stop", "--help"], "SIGKILL"),
        (["topic", "--help"], "KAFKA_BOOTSTRAP_SERVERS"),
        (["topic", "create", "--help"], "--max-message-bytes"),
        (["topic", "describe", "--help"], "watermarks"),
    ],
)
def test_help_explains(capsys: pytest.CaptureFixture[str], argv: list[str], expected: str) -> None:
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 0
    assert expected in capsys.readouterr().out


def test_status_of_a_stopped_broker_exits_3(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code, out, _ = run(capsys, "broker", "status", "--data-dir", str(tmp_path))
    assert code == 3 and out.startswith("stopped")
    code, out, _ = run(capsys, "broker", "status", "--data-dir", str(tmp_path), "--json")
    assert code == 3
    assert json.loads(out)["running"] is False


def test_stop_when_nothing_runs(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code, out, _ = run(capsys, "broker", "stop", "--data-dir", str(tmp_path))
    assert code == 0 and "no broker was running" in out


def test_topic_commands_without_any_broker_say_how_to_get_one(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv("KAFKA_BOOTSTRAP_SERVERS", raising=False)
    monkeypatch.setenv("KVEVENTS_BROKER_DIR", str(tmp_path / "none"))
    code, _, err = run(capsys, "topic", "describe", "events")
    assert code == 1
    assert "KAFKA_BOOTSTRAP_SERVERS" in err and "kvevents broker start" in err


def test_topic_create_rejects_bad_settings_before_connecting(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(capsys, "topic", "create", "bad/name", "-b", "127.0.0.1:1")
    assert code == 2 and "invalid topic name" in err
    code, _, err = run(capsys, "topic", "create", "t", "--partitions", "0", "-b", "127.0.0.1:1")
    assert code == 2 and "partitions must be >= 1" in err


def test_topic_create_config_must_be_key_value(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["topic", "create", "t", "--config", "segment.ms"])
    assert exited.value.code == 2
    assert "expected KEY=VALUE" in capsys.readouterr().err
