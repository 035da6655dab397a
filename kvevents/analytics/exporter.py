"""``export_parquet``: read a topic with :class:`~kvevents.consumer.EventReader` (raw messages),
decode each batch, and write its rows into an export directory chunk by chunk
(:class:`~kvevents.analytics.parquet_sink.ParquetSink`), resuming from the directory's state."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvevents.consumer import EventReader
from kvevents.schemas import DecodeError

from .parquet_sink import ParquetSink, PartitionNameError, check_instance_folder
from .rows import RowBuffer, date_of

__all__ = ["ExportProgress", "ExportResult", "export_parquet"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ExportProgress:
    """Where an export is: this run's messages, rows, malformed messages, seconds, lag."""

    messages: int
    rows: int
    malformed: int
    seconds: float
    lag: int
    files_rows: int

    @property
    def rows_per_s(self) -> float:
        return self.rows / self.seconds if self.seconds > 0 else 0.0


@dataclass(frozen=True)
class ExportResult(ExportProgress):
    """The end of a run: also the chunks written and the offsets the next run starts from."""

    chunks: int
    offsets: dict[int, int]
    leftovers_removed: int
    caught_up: bool


def export_parquet(
    bootstrap_servers: str,
    topic: str,
    out: Path,
    *,
    follow: bool = False,
    rows_per_chunk: int = 1_000_000,
    flush_interval_s: float = 30.0,
    max_messages: int | None = None,
    config: Mapping[str, Any] | None = None,
    progress: Callable[[ExportProgress], None] | None = None,
    progress_interval_s: float = 1.0,
    on_reader: Callable[[EventReader], None] | None = None,
    codec: Any = None,
) -> ExportResult:
    """Export ``topic`` into ``out`` from where the last run stopped; until caught up (default)
    or, with ``follow``, until the reader is stopped (``on_reader`` receives it, e.g. to call
    ``stop()`` on Ctrl-C). A chunk is closed every ``rows_per_chunk`` rows, every
    ``flush_interval_s`` seconds, and at the end."""
    if rows_per_chunk < 1:
        raise ValueError("rows_per_chunk must be >= 1")
    sink = ParquetSink(out, topic)
    state = sink.state
    reader = EventReader(bootstrap_servers, topic, start=dict(state.offsets), config=config, codec=codec)
    if on_reader is not None:
        on_reader(reader)
    buffers: dict[tuple[str, str], RowBuffer] = {}
    pending_rows = 0
    pending_messages = 0
    next_offsets: dict[int, int] = {}
    malformed: list[dict[str, Any]] = []
    totals = {"messages": 0, "rows": 0, "malformed": 0, "chunks": 0}
    started = time.monotonic()
    chunk_started = started
    next_report = started + progress_interval_s

    def lag() -> int:
        return sum(p.lag or 0 for p in reader.metrics().partitions)

    def report() -> None:
        if progress is not None:
            progress(
                ExportProgress(
                    totals["messages"],
                    totals["rows"],
                    totals["malformed"],
                    time.monotonic() - started,
                    lag(),
                    state.rows,
                )
            )

    def flush() -> None:
        nonlocal pending_rows, pending_messages, chunk_started
        if not next_offsets:
            return
        tables = {key: buffer.table() for key, buffer in buffers.items()}
        sink.write_chunk(tables, next_offsets, messages=pending_messages, malformed=malformed)
        totals["chunks"] += 1
        buffers.clear()
        next_offsets.clear()
        malformed.clear()
        pending_rows = pending_messages = 0
        chunk_started = time.monotonic()

    try:
        for message in reader.messages(until_caught_up=not follow, max_messages=max_messages):
            partition, offset = message.partition(), message.offset()
            _kind, timestamp_ms = message.timestamp()
            try:
                batch = reader.decode(message.value())
                check_instance_folder(batch.instance_id)
            except (DecodeError, PartitionNameError) as exc:
                log.warning("set aside a malformed message at %s[%d]@%d: %s", topic, partition, offset, exc)
                malformed.append({"partition": partition, "offset": offset, "error": str(exc)})
                totals["malformed"] += 1
            else:
                timestamp_us = timestamp_ms * 1000
                key = (date_of(timestamp_us), batch.instance_id)
                buffer = buffers.get(key)
                if buffer is None:
                    buffer = buffers[key] = RowBuffer()
                added = buffer.add_batch(batch, partition, offset, timestamp_us)
                pending_rows += added
                totals["rows"] += added
            next_offsets[partition] = offset + 1
            pending_messages += 1
            totals["messages"] += 1
            now = time.monotonic()
            if pending_rows >= rows_per_chunk or now - chunk_started >= flush_interval_s:
                flush()
            if now >= next_report:
                report()
                next_report = now + progress_interval_s
        flush()
        report()
        caught_up = reader.caught_up
        offsets = dict(state.offsets)
    finally:
        reader.close()
    elapsed = time.monotonic() - started
    return ExportResult(
        messages=totals["messages"],
        rows=totals["rows"],
        malformed=totals["malformed"],
        seconds=elapsed,
        lag=0,
        files_rows=state.rows,
        chunks=totals["chunks"],
        offsets=offsets,
        leftovers_removed=sink.removed_leftovers,
        caught_up=caught_up,
    )
