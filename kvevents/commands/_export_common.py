"""What ``kvevents export zmq`` and ``export dynamo`` share: where to start reading (``--from``,
``--from-checkpoint``, ``--follow``), ``--lora-name``, ``--wait``, and the checked broker address."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from kvevents.commands._common import CommandError, check_kafka, config_pair, resolve_bootstrap

__all__ = ["add_lora_flag", "add_start_flags", "add_wait_flag", "checked_bootstrap", "start_position"]


def add_start_flags(parser: argparse.ArgumentParser, what: str) -> Any:
    """The "what to read" group with ``--from``, ``--from-checkpoint`` and ``--follow``
    (``what``: what the command publishes, for the help); returned for more flags."""
    read = parser.add_argument_group("what to read")
    read.add_argument(
        "--from",
        dest="start",
        choices=["beginning", "end"],
        default="beginning",
        help="where a first start reads from: the oldest retained batch (default) or new ones only",
    )
    read.add_argument(
        "--from-checkpoint",
        type=Path,
        default=None,
        metavar="FILE",
        help="start at the offsets of an index checkpoint file (kvevents index --save-checkpoint): "
        "publish what came after it",
    )
    read.add_argument(
        "--follow",
        action=argparse.BooleanOptionalAction,
        default=True,
        help=f"keep publishing new {what} (default); --no-follow exits once caught up",
    )
    return read


def _lora_name(text: str) -> tuple[int, str]:
    key, value = config_pair(text)
    if not key.isdigit() or not value:
        raise argparse.ArgumentTypeError(f"expected LORA_ID=NAME, got {text!r}")
    return int(key), value


def add_lora_flag(group: Any, help: str) -> None:
    """``--lora-name ID=NAME`` (repeatable) into ``args.lora_name``: a list of (id, name)."""
    group.add_argument(
        "--lora-name", type=_lora_name, action="append", default=[], metavar="ID=NAME", help=help
    )


def add_wait_flag(group: Any, sockets: str) -> None:
    """``--wait S``: seconds between opening ``sockets`` and the first publish."""
    group.add_argument(
        "--wait",
        type=float,
        default=0.0,
        metavar="S",
        help=f"seconds to wait after opening {sockets} before publishing, so that subscribers "
        "connect and subscribe (a PUB drops what it sends before)",
    )


def start_position(args: argparse.Namespace) -> Any:
    """``--from`` or, with ``--from-checkpoint``, that checkpoint's offsets (CommandError naming
    the file when it cannot be read or is another topic's)."""
    if args.from_checkpoint is None:
        return args.start
    from kvevents.consumer import CheckpointError, load_checkpoint

    try:
        return dict(load_checkpoint(args.from_checkpoint, topic=args.topic).offsets)
    except CheckpointError as exc:
        raise CommandError(str(exc)) from exc


def checked_bootstrap(args: argparse.Namespace) -> str:
    """The broker's address once it answered with the topic's metadata (CommandError otherwise)."""
    bootstrap = resolve_bootstrap(args)
    check_kafka(args, bootstrap, topic=args.topic)
    return bootstrap
