"""Read a fault case's topic back: which events arrived, how often, and what was reported lost.

Per event key (instance, attention-DP rank, event id): delivered once or more (the excess is
``duplicated``), the in-band drop counts (``EventBatch.dropped``, ignoring replayed batches'
copies by counting each (producer, sequence) once), malformed messages, and what a
:class:`~kvevents.consumer.CacheIndex` made of it all (``events_applied`` must equal the
distinct events: the index's dedup).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from kvevents.consumer import CacheIndex, EventReader, WorkerKey


@dataclass
class TopicAudit:
    messages: int = 0
    events: int = 0
    distinct_events: int = 0
    duplicated: int = 0
    dropped_in_band: int = 0
    malformed: int = 0
    index_events_applied: int = 0
    index_events_duplicate: int = 0
    degraded: list[WorkerKey] = field(default_factory=list)
    distinct_by_worker: dict[str, int] = field(default_factory=dict)

    @property
    def duplicated_after_dedup(self) -> int:
        """Events the index applied more than once (applied beyond the distinct ones)."""
        return max(0, self.index_events_applied - self.distinct_events)


def audit_topic(bootstrap: str, topic: str, config: dict[str, str] | None = None) -> TopicAudit:
    """Everything in ``topic`` now (from the beginning to the high watermarks)."""
    seen: Counter[tuple[str, int, int]] = Counter()
    batches_seen: set[tuple[int, int]] = set()
    result = TopicAudit()
    index = CacheIndex()
    with EventReader(bootstrap, topic, config=config) as reader:
        for batch in reader.batches(until_caught_up=True):
            result.messages += 1
            index.apply(batch)
            first_copy = (batch.producer_id, batch.sequence) not in batches_seen
            batches_seen.add((batch.producer_id, batch.sequence))
            if first_copy:
                result.dropped_in_band += sum(max(0, d.dropped_events) for d in batch.dropped)
            for event in batch.events:
                seen[(batch.instance_id, event.attention_dp_rank or 0, event.event_id)] += 1
            result.events += len(batch.events)
        result.malformed = reader.metrics().malformed_total
    result.distinct_events = len(seen)
    result.duplicated = result.events - result.distinct_events
    counters = index.counters()
    result.index_events_applied = counters["events_applied"]
    result.index_events_duplicate = counters["events_duplicate"]
    result.degraded = index.degraded_workers()
    by_worker: Counter[str] = Counter(f"{i}/{r}" for i, r, _ in seen)
    result.distinct_by_worker = dict(by_worker)
    return result
