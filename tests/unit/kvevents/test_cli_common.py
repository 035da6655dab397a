"""The shared CLI helpers: flags, bootstrap resolution, the command wrapper, progress, Ctrl-C."""

from __future__ import annotations

import argparse
import io
import logging
import os
import signal
from pathlib import Path

import pytest

from kvevents.cli import build_parser, main
from kvevents.commands._common import (
    EXIT_INTERRUPTED,
    CommandError,
    Progress,
    add_kafka_flags,
    add_output_flags,
    command,
    config_pair,
    kafka_config,
    logging_level,
    resolve_bootstrap,
    stop_on_interrupt,
)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    add_kafka_flags(p)
    add_output_flags(p)
    return p


def test_kafka_flags_defaults_and_repeatable_X() -> None:
    args = parser().parse_args(
        ["-X", "fetch.max.bytes=1024", "-X", "client.id=a=b", "-X", "fetch.max.bytes=2048"]
    )
    assert args.topic == "kv-cache-events" and args.bootstrap_servers is None
    assert kafka_config(args) == {"fetch.max.bytes": "2048", "client.id": "a=b"}  # later wins; '=' in values
    assert args.json is False and args.quiet is False


@pytest.mark.parametrize("bad", ["novalue", "=x", ""])
def test_X_needs_key_equals_value(bad: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match="KEY=VALUE"):
        config_pair(bad)
    with pytest.raises(SystemExit) as exited:
        parser().parse_args(["-X", bad])
    assert exited.value.code == 2 and "KEY=VALUE" in capsys.readouterr().err


def test_logging_level_from_quiet_and_verbose() -> None:
    assert logging_level(parser().parse_args([])) == logging.WARNING
    assert logging_level(parser().parse_args(["-v"])) == logging.INFO
    assert logging_level(parser().parse_args(["-vvv"])) == logging.DEBUG
    assert logging_level(parser().parse_args(["-q", "-v"])) == logging.ERROR


def test_top_level_verbose_survives_a_command_without_its_own() -> None:
    args = build_parser().parse_args(["-vv", "tail"])
    assert args.verbose == 2
    args = build_parser().parse_args(["tail", "-v"])
    assert args.verbose == 1


def test_bootstrap_resolution_order(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("KVEVENTS_BROKER_DIR", str(tmp_path / "none"))
    monkeypatch.setenv("KAFKA_BOOTSTRAP_SERVERS", "envhost:1")
    assert resolve_bootstrap(parser().parse_args(["-b", "flag:2"])) == "flag:2"
    assert resolve_bootstrap(parser().parse_args([])) == "envhost:1"
    monkeypatch.delenv("KAFKA_BOOTSTRAP_SERVERS")
    with pytest.raises(CommandError, match="kvevents broker start"):
        resolve_bootstrap(parser().parse_args([]))


def test_command_wrapper_turns_errors_and_ctrl_c_into_exit_codes(capsys: pytest.CaptureFixture[str]) -> None:
    @command("demo")
    def fails(args: argparse.Namespace) -> int:
        raise CommandError("the topic is gone", code=3)

    @command("demo")
    def interrupted(args: argparse.Namespace) -> int:
        raise KeyboardInterrupt

    args = parser().parse_args([])
    assert fails(args) == 3
    assert capsys.readouterr().err == "kvevents demo: the topic is gone\n"
    assert interrupted(args) == EXIT_INTERRUPTED
    assert "interrupted" in capsys.readouterr().err


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class TtyStream(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_off_a_tty_prints_a_line_per_interval() -> None:
    stream, clock = io.StringIO(), FakeClock()
    progress = Progress(stream, interval=5.0, clock=clock)
    progress.update("a")
    clock.now = 2.0
    progress.update("b")  # too soon
    clock.now = 5.5
    progress.update("c")
    progress.done("final")
    assert stream.getvalue() == "a\nc\nfinal\n"


def test_progress_on_a_tty_rewrites_one_line() -> None:
    stream, clock = TtyStream(), FakeClock()
    progress = Progress(stream, clock=clock)
    assert progress.interval < 1
    progress.update("long text")
    clock.now = 1.0
    progress.update("short")
    progress.done()
    assert stream.getvalue() == "\rlong text\rshort    \n"


def test_progress_disabled_prints_nothing() -> None:
    stream = io.StringIO()
    progress = Progress(stream, enabled=False)
    progress.update("x", force=True)
    progress.done("y")
    assert stream.getvalue() == "" and not progress.due()


def test_first_ctrl_c_stops_the_work_the_second_raises() -> None:
    stops: list[int] = []
    before = signal.getsignal(signal.SIGINT)
    with stop_on_interrupt(lambda: stops.append(1)) as interrupted:
        assert not interrupted
        os.kill(os.getpid(), signal.SIGINT)
        assert interrupted and stops == [1]
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
    assert signal.getsignal(signal.SIGINT) is before


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["tail", "--help"], "--from-beginning"),
        (["index", "--help"], "--checkpoint-topic"),
        (["route", "--help"], "POST /match"),
        (["stats", "--help"], "--plot"),
    ],
)
def test_every_command_has_help_with_the_shared_flags(
    capsys: pytest.CaptureFixture[str], argv: list[str], expected: str
) -> None:
    with pytest.raises(SystemExit) as exited:
        main(argv)
    out = capsys.readouterr().out
    assert exited.value.code == 0
    for flag in (expected, "--bootstrap-servers", "--topic", "-X KEY=VALUE", "--quiet", "--verbose"):
        assert flag in out, flag


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--lora-id", str(1 << 64)], "--lora-id must be within 0..2**64-1"),  # was a ValueError traceback
        (["--lora-id", "-1"], "--lora-id must be within 0..2**64-1"),
        (["--block-size", "0"], "--block-size must be >= 1"),
    ],
)
def test_route_names_a_bad_scoring_flag_before_reading_kafka(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, flags: list[str], message: str
) -> None:
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("1 2 3 4\n")
    assert main(["route", "--tokens", str(prompts), "-b", "127.0.0.1:1", *flags]) == 2
    assert message in capsys.readouterr().err
