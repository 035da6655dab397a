"""The ``kvevents`` command line: one sub-command per module of ``kvevents.commands``.

Each command module defines ``register(subparsers)``, which adds its parser and sets
``func`` to the function that runs it (``func(args) -> int``). Heavy imports stay inside
those functions so that ``kvevents --help`` answers at once.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import pkgutil
import sys

from kvevents import __version__, commands


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser with every command registered."""
    parser = argparse.ArgumentParser(
        prog="kvevents",
        description="Stream the KV-cache events of LLM inference engines through Apache Kafka, "
        "and rebuild a global prefix-cache index from them.",
        epilog="Run 'kvevents COMMAND --help' for a command's options. Kafka commands honour "
        "KAFKA_BOOTSTRAP_SERVERS.",
    )
    parser.add_argument("--version", action="version", version=f"kvevents {__version__}")
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more logging (-vv for debug)")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module_info in sorted(pkgutil.iter_modules(commands.__path__), key=lambda m: m.name):
        if module_info.name.startswith("_"):
            continue
        module = importlib.import_module(f"kvevents.commands.{module_info.name}")
        module.register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the CLI; returns the process exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    level = logging.WARNING - 10 * min(args.verbose, 2)
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.command is None:
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
