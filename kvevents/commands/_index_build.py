"""Building a :class:`~kvevents.consumer.CacheIndex` from the topic, for ``index`` and ``route``:
flags, the start (fresh, a checkpoint file, or the Kafka checkpoint store), the rebuild with
progress on stderr, worker liveness tracked as ``LiveIndex`` does, and saving checkpoints."""

from __future__ import annotations

import argparse
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvevents.commands._common import (
    CommandError,
    Progress,
    check_kafka,
    kafka_config,
    reader_codec,
    resolve_bootstrap,
)

if TYPE_CHECKING:
    from kvevents.consumer import CacheIndex, Checkpoint, EventReader, Liveness, ReaderProgress, ReadResult

__all__ = [
    "Built",
    "add_index_flags",
    "build_index",
    "capture_and_save",
    "catch_up_with_topic",
    "describe_progress",
    "save_checkpoint_to",
]

log = logging.getLogger(__name__)


def add_index_flags(parser: argparse.ArgumentParser, *, saves: bool = True) -> None:
    """Where the index starts from and (``saves``) where its checkpoints go."""
    group = parser.add_argument_group("index state and checkpoints")
    group.add_argument(
        "--checkpoint",
        type=Path,
        default=None,
        metavar="FILE",
        help="start from this checkpoint file, then catch up from its offsets"
        + (
            " (a missing FILE is an error, unless it is also --save-checkpoint: then the first run "
            "rebuilds from the beginning)"
            if saves
            else ""
        ),
    )
    group.add_argument(
        "--checkpoint-topic",
        default=None,
        metavar="TOPIC",
        help="the compacted Kafka topic of checkpoints (created if missing): start from its latest "
        "checkpoint named --checkpoint-name, if any (unless --checkpoint is given)"
        + (", and save there" if saves else ""),
    )
    group.add_argument(
        "--checkpoint-name",
        default="default",
        help="the checkpoint's name in --checkpoint-topic (default: default)",
    )
    group.add_argument(
        "--core",
        choices=["auto", "compiled", "python"],
        default="auto",
        help="the index core (default: auto, the compiled one when built)",
    )


@dataclass
class Built:
    """An index caught up with the topic, the reader positioned after what it applied (open),
    where the state came from, what the rebuild read, and the instances' liveness (restored
    from the checkpoint when it carries it, then tracked by :meth:`apply`: closed instances'
    workers leave the index, as in a ``LiveIndex``)."""

    index: CacheIndex
    reader: EventReader
    source: str
    result: ReadResult | None
    bootstrap: str
    liveness: Liveness

    def apply(self, **options: Any) -> ReadResult:
        """``reader.apply_to(index, **options)``, tracking liveness."""
        from kvevents.consumer.follower import observe_liveness

        def observe(message: Any) -> None:
            observe_liveness(self.liveness, self.index, message)

        return self.reader.apply_to(self.index, on_message=observe, **options)

    def close(self) -> None:
        self.reader.close()


def describe_progress(p: ReaderProgress) -> str:
    """One progress line: share of the target read, events, rate, lag."""
    return (
        f"rebuilding: {p.fraction * 100:5.1f}% {p.messages:,} msgs {p.events:,} events "
        f"{p.bytes / 1e6:,.1f} MB {p.events_per_s:,.0f} ev/s lag {p.lag:,} msgs {p.elapsed_s:.1f} s"
        + (f" malformed {p.malformed}" if p.malformed else "")
    )


def _checkpoint_store(args: argparse.Namespace, bootstrap: str) -> Any:
    from kvevents.consumer import KafkaCheckpointStore

    return KafkaCheckpointStore(
        bootstrap, args.checkpoint_topic, name=args.checkpoint_name, config=kafka_config(args)
    )


def _load_checkpoint(args: argparse.Namespace, bootstrap: str) -> tuple[Checkpoint | None, str]:
    from kvevents.consumer import CheckpointError, load_checkpoint

    path: Path | None = args.checkpoint
    try:
        if path is not None:
            if not path.exists() and getattr(args, "save_checkpoint", None) == path:
                log.warning(
                    "%s does not exist yet: rebuilding from the beginning (it will be saved there)", path
                )
            else:
                checkpoint = load_checkpoint(path, topic=args.topic)
                return checkpoint, f"checkpoint file {path}"
        if args.checkpoint_topic:
            store = _checkpoint_store(args, bootstrap)
            store.create_topic()
            loaded = store.load(topic=args.topic)
            if loaded is not None:
                return loaded, f"checkpoint {args.checkpoint_name!r} in topic {args.checkpoint_topic!r}"
    except CheckpointError as exc:
        raise CommandError(str(exc)) from exc
    return None, "the beginning of the topic"


def build_index(
    args: argparse.Namespace, *, catch_up: bool = True, progress: Progress | None = None
) -> Built:
    """The index from the checkpoint (if any) caught up with the topic (``catch_up``); raises
    :class:`CommandError` for a missing topic, a bad checkpoint, no broker."""
    from kvevents.consumer import CacheIndex, CheckpointError, EventReader, Liveness, ReaderError

    bootstrap = resolve_bootstrap(args)
    check_kafka(args, bootstrap, topic=args.topic)
    checkpoint, source = _load_checkpoint(args, bootstrap)
    try:
        index = checkpoint.index(core=args.core) if checkpoint is not None else CacheIndex(core=args.core)
    except (CheckpointError, RuntimeError) as exc:
        raise CommandError(str(exc)) from exc
    try:
        reader = EventReader(
            bootstrap,
            args.topic,
            start=checkpoint.offsets if checkpoint is not None else "beginning",
            config=kafka_config(args),
            codec=reader_codec(args),
        )
    except (ReaderError, ValueError) as exc:
        raise CommandError(str(exc)) from exc
    liveness = Liveness()
    if checkpoint is not None and checkpoint.liveness is not None:
        liveness.restore(checkpoint.liveness)
    built = Built(index, reader, source, None, bootstrap, liveness)
    if catch_up:
        try:
            catch_up_with_topic(built, progress)
        except BaseException:
            reader.close()
            raise
    return built


def catch_up_with_topic(built: Built, progress: Progress | None = None) -> None:
    """Apply the topic up to the watermarks captured when the reader started (or until the
    reader is stopped) and keep what it read in ``built.result``."""
    from kvevents.consumer import ReaderError

    show = progress or Progress(enabled=False)
    try:
        built.result = built.apply(
            progress=lambda p: show.update(describe_progress(p)),
            progress_interval_s=min(1.0, show.interval),
        )
    except ReaderError as exc:
        raise CommandError(str(exc)) from exc


def capture_and_save(args: argparse.Namespace, built: Built) -> list[str]:
    """Save a checkpoint of ``built`` to ``--save-checkpoint`` and/or ``--checkpoint-topic``;
    returns one line per place saved."""
    from kvevents.consumer import Checkpoint

    if getattr(args, "save_checkpoint", None) is None and not args.checkpoint_topic:
        return []
    return save_checkpoint_to(
        args, Checkpoint.capture(built.index, built.reader, built.liveness), built.bootstrap
    )


def save_checkpoint_to(args: argparse.Namespace, checkpoint: Checkpoint, bootstrap: str) -> list[str]:
    """Save ``checkpoint`` to ``--save-checkpoint`` and/or ``--checkpoint-topic``; one line per
    place saved."""
    from kvevents.consumer import CheckpointError, save_checkpoint

    targets: list[str] = []
    path: Path | None = getattr(args, "save_checkpoint", None)
    try:
        if path is not None:
            size = save_checkpoint(path, checkpoint)
            targets.append(f"checkpoint saved to {path} ({size:,} bytes, {checkpoint.messages:,} messages)")
        if args.checkpoint_topic:
            saved = _checkpoint_store(args, bootstrap).save(checkpoint)
            targets.append(
                f"checkpoint {args.checkpoint_name!r} saved to topic {args.checkpoint_topic!r} "
                f"({saved.bytes:,} bytes in {saved.chunks} chunk(s), slot {saved.slot})"
            )
    except (CheckpointError, OSError) as exc:
        raise CommandError(f"saving the checkpoint: {exc}") from exc
    return targets
