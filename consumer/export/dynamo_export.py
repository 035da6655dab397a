"""``kvevents export dynamo``: the topic as NVIDIA Dynamo ``RouterEvent`` JSON lines.

Each line is ``{"worker_id": <u64>, "event": {"event_id", "data", "dp_rank"}}`` (Dynamo's
``RouterEvent``; the ``event`` is :func:`kvevents.consumer.dynamo.router_events`' dict). Worker
ids: Dynamo's are integers, kvevents' instance ids are names, so each instance gets
:func:`~kvevents.consumer.dynamo.worker_id_for` unless ``worker_ids`` names it.

Duplicates (event id not above the worker's last) are skipped; a worker whose events were lost
(in-band drops, missing batches, an event-id jump, an unreadable message of its instance) gets a
``"cleared"`` event first, with the lost event's id, so Dynamo drops the stale view; the
producer's snapshot (Created + Stored) refills it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from kvevents.schemas import (
    EventBatch,
    KVCacheCreatedData,
    KVCacheEvent,
    KVCacheRemovedData,
    KVCacheStoredData,
)

from ..dynamo import block_namespaces, router_event, worker_id_for
from ..workers import WorkerKey

__all__ = ["DynamoConverter", "DynamoCounters"]

log = logging.getLogger(__name__)


@dataclass
class DynamoCounters:
    batches: int = 0
    events_in: int = 0
    events_out: int = 0
    duplicates: int = 0
    clears_for_loss: int = 0
    blocks_left_out: int = 0
    """Stored blocks left out: from a block without tokens, or with a negative token id, on
    (``router_event``)."""
    loss_reasons: dict[str, int] = field(default_factory=dict)


class DynamoConverter:
    """Batches in topic order -> ``RouterEvent`` dicts (module docstring)."""

    def __init__(
        self,
        *,
        lora_names: Mapping[int, str] | None = None,
        worker_ids: Mapping[str, int] | None = None,
        window_size: int | None = None,
        on_loss: Callable[[WorkerKey, str], None] | None = None,
    ) -> None:
        self.lora_names = dict(lora_names or {})
        self.worker_ids = dict(worker_ids or {})
        self.window_size = window_size
        self.counters = DynamoCounters()
        self._cursors: dict[WorkerKey, int] = {}
        self._known: set[WorkerKey] = set()
        self._ranks: dict[str, set[int]] = {}
        """Per instance, the ranks of ``_known``: a session change or a gap looks at its own
        workers, not every instance's (32k instances made each 4.7 ms)."""
        self._sessions: dict[str, tuple[int, int]] = {}
        self._namespaces: dict[WorkerKey, dict[int, str]] = {}
        """Per worker, the Dynamo namespace (cache salt) of each salted block held, for the
        events that continue its chain (``block_namespaces``)."""
        self._on_loss = on_loss

    def worker_id(self, instance: str) -> int:
        found = self.worker_ids.get(instance)
        if found is None:
            found = self.worker_ids[instance] = worker_id_for(instance)
        return found

    def _clear(self, out: list[dict[str, Any]], key: WorkerKey, event_id: int, reason: str) -> None:
        c = self.counters
        c.clears_for_loss += 1
        c.loss_reasons[reason] = c.loss_reasons.get(reason, 0) + 1
        rank = key.attention_dp_rank
        self._namespaces.pop(key, None)
        out.append(
            {
                "worker_id": self.worker_id(key.instance_id),
                "event": {"event_id": event_id, "data": "cleared", "dp_rank": rank},
            }
        )
        if self._on_loss is not None:
            self._on_loss(key, reason)

    def lose_instance(self, instance: str, reason: str) -> list[dict[str, Any]]:
        """``cleared`` for every known worker of ``instance``."""
        out: list[dict[str, Any]] = []
        for rank in sorted(self._ranks.get(instance, ())):
            key = WorkerKey(instance, rank)
            self._clear(out, key, self._cursors.get(key, 0), reason)
        return out

    def convert(self, batch: EventBatch) -> list[dict[str, Any]]:
        """The ``RouterEvent`` dicts of one batch, in order."""
        c = self.counters
        c.batches += 1
        c.events_in += len(batch.events)
        out: list[dict[str, Any]] = []
        instance = batch.instance_id
        lost_ranks: dict[int, str] = {}
        session = self._sessions.get(instance)
        replay = False
        if session is None or session[0] != batch.producer_id:
            if session is not None:
                ranks = self._ranks.get(instance, ())
                if batch.sequence != 0:
                    for rank in ranks:
                        lost_ranks[rank] = "a new producer session did not start at 0"
                for rank in ranks:
                    self._cursors.pop(WorkerKey(instance, rank), None)  # event ids restart with a new session
            self._sessions[instance] = (batch.producer_id, batch.sequence)
        elif batch.sequence <= session[1]:
            replay = True
        else:
            if batch.sequence > session[1] + 1:
                for rank in self._ranks.get(instance, ()):
                    lost_ranks[rank] = f"batches {session[1] + 1}..{batch.sequence - 1} are missing"
            self._sessions[instance] = (batch.producer_id, batch.sequence)
        if not replay:
            for drop in batch.dropped:
                if drop.dropped_events > 0:
                    lost_ranks[drop.attention_dp_rank] = f"{drop.dropped_events} events dropped"
        fragment = batch.first_event_block_offset > 0 and not replay
        kept: list[tuple[KVCacheEvent, WorkerKey]] = []
        keys: dict[int | None, WorkerKey] = {}  # a batch has few ranks: one key each
        for i, event in enumerate(batch.events):
            key = keys.get(event.attention_dp_rank)
            if key is None:
                key = keys[event.attention_dp_rank] = WorkerKey(instance, event.attention_dp_rank or 0)
            cursor = self._cursors.get(key)
            eid = event.event_id
            if cursor is not None:
                if eid <= cursor and not (i == 0 and fragment and eid == cursor):
                    c.duplicates += 1
                    continue
                if eid > cursor + 1 and key.attention_dp_rank not in lost_ranks:
                    lost_ranks[key.attention_dp_rank] = f"event ids jumped from {cursor} to {eid}"
            self._cursors[key] = eid
            if key not in self._known:
                self._known.add(key)
                self._ranks.setdefault(instance, set()).add(key.attention_dp_rank)
            kept.append((event, key))
        for rank, reason in sorted(lost_ranks.items()):
            key = WorkerKey(instance, rank)
            first = next((e.event_id for e, k in kept if k.attention_dp_rank == rank), None)
            self._clear(out, key, first if first is not None else self._cursors.get(key, 0), reason)
            if first is None:  # the ids that follow a loss jump by design: not a second loss
                self._cursors.pop(key, None)
        if kept:
            worker_id = self.worker_id(instance)
            window = self.window_size
            lora_names = self.lora_names
            for event, key in kept:
                if window is not None and event.window_size != window:
                    continue
                mapped = self._mapped(key, event, lora_names)
                if type(event.data) is KVCacheStoredData:
                    sent = len(mapped["data"]["stored"]["blocks"]) if mapped is not None else 0
                    c.blocks_left_out += len(event.data.blocks) - sent
                if mapped is not None:
                    out.append({"worker_id": worker_id, "event": mapped})
        c.events_out += len(out)
        return out

    def _mapped(
        self, key: WorkerKey, event: KVCacheEvent, lora_names: Mapping[int, str]
    ) -> dict[str, Any] | None:
        """``router_event`` with the salt lineage of ``key``, the event's worker, kept up to date."""
        data = event.data
        held = self._namespaces.get(key)
        if type(data) is KVCacheStoredData:
            parent = None if held is None or data.parent_hash is None else held.get(data.parent_hash)
            namespaces = block_namespaces(data.blocks, parent)
            if any(ns is not None for ns in namespaces):
                if held is None:
                    held = self._namespaces[key] = {}
                for block, ns in zip(data.blocks, namespaces, strict=True):
                    if ns is not None:
                        held[block.block_hash] = ns
            return router_event(event, lora_names, parent_namespace=parent)
        if held is not None:
            if isinstance(data, KVCacheRemovedData):
                for h in data.block_hashes:
                    held.pop(h, None)
            elif isinstance(data, KVCacheCreatedData):
                del self._namespaces[key]
        return router_event(event, lora_names)
