"""Flags and helpers every ``kvevents`` command shares, so that all of them spell things alike.

- :func:`add_kafka_flags`: ``--bootstrap-servers/-b`` (resolved like :mod:`kvevents.broker.bootstrap`),
  ``--topic/-t`` (default ``kv-cache-events``), ``-X key=value`` (repeatable, passed to
  librdkafka unchanged, like kcat);
- :func:`add_output_flags`: ``--json``, ``-q/--quiet``, ``-v/--verbose``;
- :func:`command`: wraps a command's body: sets the logging level, turns :class:`CommandError`
  into ``kvevents NAME: message`` on stderr, and Ctrl-C into exit code 130;
- :class:`Progress`: long work reported on stderr (one updating line on a TTY, a line every few
  seconds otherwise); results go to stdout.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from types import FrameType
from typing import TextIO

__all__ = [
    "BOOTSTRAP_HELP",
    "DEFAULT_TOPIC",
    "EXIT_INTERRUPTED",
    "CommandError",
    "Progress",
    "add_kafka_flags",
    "add_output_flags",
    "command",
    "config_pair",
    "kafka_config",
    "resolve_bootstrap",
    "stop_on_interrupt",
]

DEFAULT_TOPIC = "kv-cache-events"
EXIT_INTERRUPTED = 130

BOOTSTRAP_HELP = "Kafka address (default: $KAFKA_BOOTSTRAP_SERVERS, else the running local broker)"


class CommandError(Exception):
    """A failure the user can act on: printed as ``kvevents NAME: message``, exit ``code``."""

    def __init__(self, message: str, code: int = 1) -> None:
        super().__init__(message)
        self.code = code


def config_pair(text: str) -> tuple[str, str]:
    """Parse ``key=value`` (an argparse ``type``); the value may itself hold ``=``."""
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    return key.strip(), value


def add_kafka_flags(parser: argparse.ArgumentParser, *, topic: bool = True) -> None:
    """Add ``--bootstrap-servers/-b``, ``--topic/-t`` (when ``topic``) and ``-X key=value``."""
    group = parser.add_argument_group("Kafka")
    group.add_argument("--bootstrap-servers", "-b", default=None, metavar="HOST:PORT", help=BOOTSTRAP_HELP)
    if topic:
        group.add_argument(
            "--topic", "-t", default=DEFAULT_TOPIC, help=f"the events topic (default: {DEFAULT_TOPIC})"
        )
    group.add_argument(
        "-X",
        dest="kafka_config",
        type=config_pair,
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a librdkafka setting passed unchanged to the Kafka client (repeatable), e.g. -X fetch.max.bytes=1048576; "
        "settings from a file (credentials): KVEVENTS_KAFKA_CONFIG=FILE of key=value lines",
    )


def add_output_flags(parser: argparse.ArgumentParser, *, json_help: str | None = "print JSON") -> None:
    """Add ``--json`` (unless ``json_help`` is None), ``-q/--quiet`` and ``-v/--verbose``."""
    group = parser.add_argument_group("output")
    if json_help is not None:
        group.add_argument("--json", action="store_true", help=json_help)
    group.add_argument(
        "-q", "--quiet", action="store_true", help="only results and errors: no progress, warnings off"
    )
    # SUPPRESS keeps the top-level 'kvevents -v' count when the command's own -v is not given.
    group.add_argument(
        "-v", "--verbose", action="count", default=argparse.SUPPRESS, help="more logging (-vv for debug)"
    )


def kafka_config(args: argparse.Namespace) -> dict[str, str]:
    """The librdkafka config: ``$KVEVENTS_KAFKA_CONFIG``'s file, then the ``-X`` settings (a
    later key wins)."""
    from ._kafka_file import kafka_config_from_env

    return {**kafka_config_from_env(), **dict(getattr(args, "kafka_config", None) or [])}


def resolve_bootstrap(args: argparse.Namespace) -> str:
    """``--bootstrap-servers``, else ``$KAFKA_BOOTSTRAP_SERVERS``, else the running local broker;
    raises :class:`CommandError` saying how to get one when there is none."""
    from kvevents.broker.bootstrap import NoBrokerConfigured, resolve_bootstrap_servers

    try:
        return resolve_bootstrap_servers(getattr(args, "bootstrap_servers", None))
    except NoBrokerConfigured as exc:
        raise CommandError(str(exc)) from exc


def logging_level(args: argparse.Namespace) -> int:
    """WARNING by default, INFO with -v, DEBUG with -vv, ERROR with -q."""
    if getattr(args, "quiet", False):
        return logging.ERROR
    return logging.WARNING - 10 * min(int(getattr(args, "verbose", 0) or 0), 2)


def command(
    name: str,
) -> Callable[[Callable[[argparse.Namespace], int]], Callable[[argparse.Namespace], int]]:
    """Decorate a command's ``func(args) -> int``: logging level from -q/-v, :class:`CommandError`
    printed as ``kvevents NAME: message`` with its code, Ctrl-C -> exit 130 (a command that has a
    summary to print catches KeyboardInterrupt itself and returns :data:`EXIT_INTERRUPTED`)."""

    def decorate(func: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
        @functools.wraps(func)
        def run(args: argparse.Namespace) -> int:
            logging.getLogger().setLevel(logging_level(args))
            try:
                return int(func(args) or 0)
            except CommandError as exc:
                print(f"kvevents {name}: {exc}", file=sys.stderr)
                return exc.code
            except KeyboardInterrupt:
                print(f"kvevents {name}: interrupted", file=sys.stderr)
                return EXIT_INTERRUPTED
            except BrokenPipeError:  # 'kvevents tail | head': the reader left; not an error
                with contextlib.suppress(OSError):
                    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
                return 0

        return run

    return decorate


class Progress:
    """Progress of long work on stderr: one line rewritten in place when the stream is a TTY,
    otherwise a plain line at most every ``interval`` seconds. Silent when ``enabled`` is False."""

    def __init__(
        self,
        stream: TextIO | None = None,
        *,
        interval: float | None = None,
        enabled: bool = True,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.interval = interval if interval is not None else (0.2 if self.tty else 5.0)
        self.enabled = enabled
        self._clock = clock
        self._last: float | None = None
        self._width = 0

    def due(self) -> bool:
        """Whether an update now would be printed (lets callers skip building the text)."""
        return self.enabled and (self._last is None or self._clock() - self._last >= self.interval)

    def update(self, text: str, *, force: bool = False) -> None:
        """Show ``text`` if the interval has passed (or ``force``)."""
        if not self.enabled or not (force or self.due()):
            return
        self._last = self._clock()
        if self.tty:
            pad = max(0, self._width - len(text))
            self.stream.write("\r" + text + " " * pad)
            self._width = len(text)
        else:
            self.stream.write(text + "\n")
        self.stream.flush()

    def done(self, text: str | None = None) -> None:
        """End the progress line (and print ``text`` as the last one, if given)."""
        if not self.enabled:
            return
        if text is not None:
            self.update(text, force=True)
        if self.tty and self._width:
            self.stream.write("\n")
            self.stream.flush()
        self._width = 0


class Interrupted:
    """Whether :func:`stop_on_interrupt` saw Ctrl-C."""

    def __init__(self) -> None:
        self.requested = False

    def __bool__(self) -> bool:
        return self.requested


@contextlib.contextmanager
def stop_on_interrupt(stop: Callable[[], None]) -> Iterator[Interrupted]:
    """Within the block, the first Ctrl-C (SIGINT) calls ``stop`` (e.g. ``EventReader.stop``)
    so that the work ends cleanly at its next step; a second one raises KeyboardInterrupt.
    Outside the main thread nothing is installed."""
    seen = Interrupted()
    if threading.current_thread() is not threading.main_thread():
        yield seen
        return

    def handler(signum: int, frame: FrameType | None) -> None:
        if seen.requested:
            raise KeyboardInterrupt
        seen.requested = True
        stop()

    previous = signal.signal(signal.SIGINT, handler)
    try:
        yield seen
    finally:
        signal.signal(signal.SIGINT, previous)
