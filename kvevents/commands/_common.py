"""Flags and helpers every ``kvevents`` command shares, so that all of them spell things alike.

- :func:`add_kafka_flags`: ``--bootstrap-servers/-b`` (resolved like :mod:`kvevents.broker.bootstrap`),
  ``--topic/-t`` (default ``kv-cache-events``), ``-F FILE`` (a librdkafka properties file) and
  ``-X key=value`` (repeatable, passed to librdkafka unchanged, like kcat), and
  ``--schema-registry-url``; :func:`kafka_config`, :func:`reader_codec` / :func:`writer_codec`
  and :func:`check_kafka` turn them into settings, codecs and a quick check of the broker;
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
from pathlib import Path
from types import FrameType
from typing import Any, TextIO

__all__ = [
    "BOOTSTRAP_HELP",
    "DEFAULT_TOPIC",
    "EXIT_INTERRUPTED",
    "CommandError",
    "Progress",
    "add_client_config_flags",
    "add_kafka_flags",
    "add_output_flags",
    "add_service_parser",
    "check_kafka",
    "command",
    "config_pair",
    "kafka_config",
    "quiet_librdkafka",
    "reader_codec",
    "registry_settings",
    "resolve_bootstrap",
    "stop_on_interrupt",
    "writer_codec",
]

DEFAULT_TOPIC = "kv-cache-events"
EXIT_INTERRUPTED = 130

BOOTSTRAP_HELP = "Kafka address (default: bootstrap.servers of -F/-X, else $KAFKA_BOOTSTRAP_SERVERS, else the running local broker)"
REGISTRY_ENV = "KVEVENTS_SCHEMA_REGISTRY_URL"
KAFKA_CONFIG_ENV = "KVEVENTS_KAFKA_CONFIG"  # a -F file by default: credentials off the command line


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


def add_kafka_flags(parser: argparse.ArgumentParser, *, topic: bool = True, registry: bool = True) -> None:
    """Add ``--bootstrap-servers/-b``, ``--topic/-t`` (when ``topic``), ``-X key=value``, ``-F FILE``
    and ``--schema-registry-url`` (when ``registry``: for commands that read or write events)."""
    group = parser.add_argument_group("Kafka")
    group.add_argument("--bootstrap-servers", "-b", default=None, metavar="HOST:PORT", help=BOOTSTRAP_HELP)
    if topic:
        group.add_argument(
            "--topic", "-t", default=DEFAULT_TOPIC, help=f"the events topic (default: {DEFAULT_TOPIC})"
        )
    add_client_config_flags(group)
    if not registry:
        return
    group.add_argument(
        "--schema-registry-url",
        default=None,
        metavar="URL",
        help="a Confluent-compatible schema registry (e.g. http://127.0.0.1:8081/apis/ccompat/v7 for "
        f"Apicurio; default: ${REGISTRY_ENV}): writers register the schema and use Confluent's framing, "
        "readers read both framings; credentials via -X/-F basic.auth.user.info=USER:PASSWORD",
    )


def add_client_config_flags(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """Add ``-X KEY=VALUE`` (repeatable) and ``-F FILE``: librdkafka settings, as kcat takes them."""
    parser.add_argument(
        "-X",
        dest="kafka_config",
        type=config_pair,
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a librdkafka setting passed unchanged to the Kafka client (repeatable, after -F), "
        "e.g. -X fetch.max.bytes=1048576",
    )
    parser.add_argument(
        "-F",
        dest="kafka_config_file",
        type=Path,
        default=None,
        metavar="FILE",
        help="read librdkafka settings from a properties file (KEY=VALUE lines, '#' comments; as kcat -F; default: $KVEVENTS_KAFKA_CONFIG); "
        "its bootstrap.servers is the Kafka address unless --bootstrap-servers is given; "
        "schema.registry.* and basic.auth.user.info lines there configure the schema registry",
    )


def add_service_parser(
    subparsers: argparse._SubParsersAction[argparse.ArgumentParser],
    name: str,
    *,
    help_text: str,
    description: str,
    epilog: str,
    data_dir_help: str,
) -> Callable[[str, str], argparse.ArgumentParser]:
    """Add the command of a local service (``broker``, ``registry``) and return its action adder.

    The adder makes one sub-command (``start``, ``stop``, ...) with ``--data-dir`` (all but
    ``fetch``, which only fills the download cache)."""
    parser = subparsers.add_parser(
        name,
        help=help_text,
        description=description,
        epilog=epilog,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    actions = parser.add_subparsers(dest=f"{name}_command", metavar="ACTION", required=True)

    def add(action: str, action_help: str) -> argparse.ArgumentParser:
        sub = actions.add_parser(action, help=action_help, description=action_help)
        if action != "fetch":
            sub.add_argument("--data-dir", type=Path, default=None, help=data_dir_help)
        return sub

    return add


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


def _settings(args: argparse.Namespace) -> tuple[dict[str, str], dict[str, str]]:
    from kvevents.commands._kafka_setup import read_properties, split_settings

    pairs: list[tuple[str, str]] = []
    path = getattr(args, "kafka_config_file", None)
    if path is None and os.environ.get(KAFKA_CONFIG_ENV, "").strip():
        path = Path(os.environ[KAFKA_CONFIG_ENV].strip())  # credentials kept off the command line
    if path is not None:
        try:
            pairs += read_properties(path)
        except ValueError as exc:
            raise CommandError(str(exc), code=2) from None
    pairs += list(getattr(args, "kafka_config", None) or [])
    return split_settings(pairs)


def kafka_config(args: argparse.Namespace) -> dict[str, str]:
    """The librdkafka settings of ``-F FILE`` then ``-X`` (a later key wins), without the
    schema registry's settings (see :func:`registry_settings`)."""
    return _settings(args)[0]


def registry_settings(args: argparse.Namespace) -> dict[str, str] | None:
    """The schema registry client's settings (``--schema-registry-url`` or ``$KVEVENTS_SCHEMA_REGISTRY_URL``
    over ``schema.registry.url`` of -F/-X, plus credentials and TLS), or None without a URL."""
    registry = _settings(args)[1]
    url = getattr(args, "schema_registry_url", None) or os.environ.get(REGISTRY_ENV, "").strip()
    if url:
        registry["url"] = url
    if not registry.get("url"):
        if registry:
            raise CommandError(
                f"schema registry settings ({', '.join(sorted(registry))}) without a URL: "
                "pass --schema-registry-url or schema.registry.url",
                code=2,
            )
        return None
    return registry


def reader_codec(args: argparse.Namespace) -> Any:
    """A :class:`~kvevents.schemas.registry.RegistryCodec` that reads both framings, when a
    registry is configured; None otherwise (single-object framing only)."""
    registry = registry_settings(args)
    if registry is None:
        return None
    from kvevents.schemas.registry import RegistryCodec

    return RegistryCodec(registry, getattr(args, "topic", None), auto_register=False)


def writer_codec(args: argparse.Namespace, topic: str) -> Any:
    """A :class:`~kvevents.schemas.registry.RegistryCodec` that registers the schema under
    ``<topic>-value`` and writes Confluent's framing, when a registry is configured; else None."""
    registry = registry_settings(args)
    if registry is None:
        return None
    from kvevents.schemas.registry import RegistryCodec

    return RegistryCodec(registry, topic)


def check_kafka(
    args: argparse.Namespace, bootstrap: str, *, topic: str | None = None, role: str = "consumer"
) -> None:
    """Fail fast with one line (:class:`CommandError`) when a -X/-F setting is refused, no broker
    answers at ``bootstrap`` within a few seconds, or ``topic`` does not exist."""
    from kvevents.commands._kafka_setup import KafkaCheckFailed
    from kvevents.commands._kafka_setup import check_kafka as check

    try:
        check(bootstrap, kafka_config(args), topic=topic, role=role)
    except KafkaCheckFailed as exc:
        raise CommandError(str(exc)) from None


def resolve_bootstrap(args: argparse.Namespace) -> str:
    """``--bootstrap-servers``, else ``bootstrap.servers`` of -F/-X (as kcat reads it), else
    ``$KAFKA_BOOTSTRAP_SERVERS``, else the running local broker; raises :class:`CommandError`
    saying how to get one when there is none (or when the -F file cannot be read)."""
    from kvevents.broker.bootstrap import NoBrokerConfigured, resolve_bootstrap_servers

    explicit = getattr(args, "bootstrap_servers", None)
    from_settings = kafka_config(args).get("bootstrap.servers", "").strip()  # reads -F first
    try:
        return resolve_bootstrap_servers(explicit or from_settings or None)
    except NoBrokerConfigured as exc:
        raise CommandError(str(exc)) from exc


def logging_level(args: argparse.Namespace) -> int:
    """WARNING by default, INFO with -v, DEBUG with -vv, ERROR with -q."""
    if getattr(args, "quiet", False):
        return logging.ERROR
    return logging.WARNING - 10 * min(int(getattr(args, "verbose", 0) or 0), 2)


def quiet_librdkafka(args: argparse.Namespace) -> None:
    """Show librdkafka's own log lines (reconnects, ...) only with ``-v``."""
    from kvevents.commands._kafka_setup import LIBRDKAFKA_LOGGERS

    level = logging_level(args)
    for logger in LIBRDKAFKA_LOGGERS:
        logging.getLogger(logger).setLevel(level if level < logging.WARNING else logging.CRITICAL)


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
            quiet_librdkafka(args)
            try:
                return int(func(args) or 0)
            except CommandError as exc:
                print(f"kvevents {name}: {exc}", file=sys.stderr)
                return exc.code
            except _kafka_exception() as exc:  # a setting librdkafka refused late, a fatal error
                err = exc.args[0] if exc.args else exc
                print(f"kvevents {name}: Kafka: {getattr(err, 'str', lambda: str(err))()}", file=sys.stderr)
                return 1
            except KeyboardInterrupt:
                print(f"kvevents {name}: interrupted", file=sys.stderr)
                return EXIT_INTERRUPTED
            except BrokenPipeError:  # 'kvevents tail | head': the reader left; not an error
                with contextlib.suppress(OSError):
                    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
                return 0

        return run

    return decorate


def _kafka_exception() -> type[Exception]:
    from confluent_kafka import KafkaException

    return KafkaException


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
