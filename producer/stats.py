"""Counters and gauges of the event buffer and the event manager, as plain Python snapshots.

Field names are Prometheus-friendly: counters end in ``_total``; a ``_by_<label>`` dict maps a
label value (window size, attention-DP rank, event type) to a count, so an exporter can turn
``events_dropped_by_rank`` into ``kvevents_events_dropped_total{attention_dp_rank="1"}``.
A snapshot is a copy: reading it never races with the threads that keep counting.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["EVENT_TYPES", "BufferStats", "ManagerStats"]

EVENT_TYPES = ("created", "stored", "removed", "updated")
"""The event types, as used for ``by_type`` labels (the JSON ``type`` of TensorRT-LLM)."""


@dataclass(frozen=True, slots=True)
class BufferStats:
    """A snapshot of one :class:`~kvevents.producer.buffer.EventBuffer`.

    - ``capacity``: most events the buffer holds; ``buffered_events``: how many it holds now;
      ``buffer_high_water_mark``: the most it ever held at once.
    - ``events_added_total``: events offered to the buffer (kept or dropped);
      ``events_dropped_total``: events lost, for any reason; ``events_dropped_by_rank``: the same
      per source attention-DP rank (0 without attention DP), including drops another rank
      reported for its own buffer; ``events_dropped_by_window_size``: drops whose window size is
      known (every drop this process made; a remote rank's reported drops have none).
    """

    capacity: int
    buffered_events: int
    buffer_high_water_mark: int
    events_added_total: int
    events_dropped_total: int
    events_dropped_by_rank: dict[int, int] = field(default_factory=dict)
    events_dropped_by_window_size: dict[int, int] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class ManagerStats:
    """A snapshot of one :class:`~kvevents.producer.manager.KVCacheEventManager`.

    - ``events_enqueued_total``: event ids handed out (a Removed hash merged into the previous
      Removed event gets none); ``removed_block_hashes_total`` / ``stored_blocks_total``: hashes
      and blocks those events carry, counted once flushed.
    - ``events_flushed_by_type``: events of each type the worker has moved to the buffer (or
      dropped on the way), keyed by ``EVENT_TYPES``; ``iterations_flushed_total``: non-empty
      ``flush()`` calls; ``pending_iterations``: flushed iterations the worker has not processed.
    - ``buffer``: the buffer's own snapshot (capacity, size, high-water mark, drops).
    - ``snapshots_published_total``: ``enqueue_snapshot`` calls; ``snapshot_requests_total``:
      losses that asked for one (several may be answered by one snapshot);
      ``snapshot_requested``: whether one is wanted now.
    """

    events_enqueued_total: int
    iterations_flushed_total: int
    pending_iterations: int
    events_flushed_by_type: dict[str, int]
    stored_blocks_total: int
    removed_block_hashes_total: int
    buffer: BufferStats
    snapshots_published_total: int = 0
    snapshot_requests_total: int = 0
    snapshot_requested: bool = False

    @property
    def events_dropped_total(self) -> int:
        """Every event lost on this manager (the buffer's total)."""
        return self.buffer.events_dropped_total
