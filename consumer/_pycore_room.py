"""Whether a batch fits the index's lifetime caps (``max_instances``, ``max_workers``,
``max_caches``, ``max_windows_per_worker``): the pure-Python core's check, made before anything
of the batch is applied (the compiled core's is ``check_room`` in ``_indexcore_workers.pxi``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvevents.schemas import EventBatch, KVCacheCreatedData, KVCacheStoredData
from kvevents.schemas.limits import check_worker_windows, index_full, instances_full, workers_full

if TYPE_CHECKING:
    from collections.abc import Collection

    from ._pycore import PyIndexCore


def check_room(core: PyIndexCore, batch: EventBatch) -> None:
    """IndexFullError unless the batch's instance, the workers its events and drops name and
    every (rank, window) cache its Stored and Created events name exist already or fit under
    the core's limits."""
    limits = core.limits
    inst = core._instances.get(batch.instance_id)
    if inst is None and len(core._instances) >= limits.max_instances:
        raise instances_full(len(core._instances), limits)
    if core._nworkers + len(batch.events) + len(batch.dropped) > limits.max_workers:
        ranks = {event.attention_dp_rank or 0 for event in batch.events}
        ranks.update(d.attention_dp_rank for d in batch.dropped if d.dropped_events > 0)
        adding = len(ranks if inst is None else ranks - inst.workers.keys())
        if core._nworkers + adding > limits.max_workers:
            raise workers_full(core._nworkers, adding, limits)
    held, top = len(core._slots), limits.max_caches
    near_caches = held + len(batch.events) > top
    # a batch adds at most max_windows_per_batch window sizes to a worker (check_batch)
    near_windows = core._widest + limits.max_windows_per_batch > limits.max_windows_per_worker
    if not (near_caches or near_windows):
        return
    caches = [
        (event.attention_dp_rank or 0, event.window_size)
        for event in batch.events
        if event.data.__class__ is KVCacheStoredData or event.data.__class__ is KVCacheCreatedData
    ]

    def windows_of(rank: int) -> Collection[int]:
        w = None if inst is None else inst.workers.get(rank)
        return () if w is None else w.slots.keys()

    if near_caches:
        new = {(rank, window) for rank, window in caches if window not in windows_of(rank)}
        if held + len(new) > top:
            raise index_full(held, len(new), limits)
    if near_windows:
        check_worker_windows(batch.instance_id, caches, windows_of, limits)
