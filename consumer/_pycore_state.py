"""Export and import of the pure-Python core's state (``IndexState``), for checkpoints.

Functions of a ``PyIndexCore`` (its methods delegate here), kept apart from the event rules.
"""

from __future__ import annotations

import sys
from array import array
from typing import TYPE_CHECKING

from ._pycore_model import Node, retired_of
from ._state import SLOT_BITS, SLOT_MAX, IndexState, InstanceState, WindowState, WorkerState

if TYPE_CHECKING:
    from ._pycore import PyIndexCore


def export_state(self: PyIndexCore) -> IndexState:
    """The core's whole state: instances, workers and their window caches, node columns."""
    worker_list = sorted(
        (w for inst in self._instances.values() for w in inst.workers.values()),
        key=lambda w: (w.instance.instance_id, w.rank),
    )
    canonical: dict[int, int] = {}
    workers = []
    for w in worker_list:
        windows = []
        for window, slot in sorted(w.slots.items()):
            s = self._slots[slot]
            if s.active:
                canonical[slot] = len(canonical)
                windows.append(WindowState(window, None if s.capacity is None else list(s.capacity)))
        workers.append(
            WorkerState(
                w.instance.instance_id,
                w.rank,
                w.cursor,
                w.last_created,
                w.session_fresh,
                w.split_blocks,
                w.split_tail,
                list(w.reasons),
                w.gaps,
                windows,
            )
        )
    instances = [
        InstanceState(
            i.instance_id,
            i.producer_id,
            i.sequence,
            list(i.retired),  # retirement order: the longest retired is forgotten first
            i.dp_size,
            list(i.retired.values()),
            list(i.pending),
        )
        for i in sorted(self._instances.values(), key=lambda i: i.instance_id)
    ]
    engine, content, has_content, counts, holders = (
        array("Q"),
        array("Q"),
        array("B"),
        array("I"),
        array("I"),
    )
    for e in sorted(self._nodes):
        node = self._nodes[e]
        engine.append(e)
        content.append(node.content or 0)
        has_content.append(node.content is not None)
        packed = [
            canonical[s] | lvl << SLOT_BITS | prio << 24
            for s, (lvl, prio) in sorted(node.holders.items(), key=lambda item: canonical[item[0]])
        ]
        counts.append(len(packed))
        holders.extend(packed)
    if sys.byteorder == "big":
        for col in (engine, content, counts, holders):
            col.byteswap()
    return IndexState(
        instances,
        workers,
        engine.tobytes(),
        content.tobytes(),
        has_content.tobytes(),
        counts.tobytes(),
        holders.tobytes(),
    )


def import_state(self: PyIndexCore, state: IndexState) -> None:
    """Replace everything with ``state`` (counters start from zero)."""
    self.__init__(self._key_factory, self.limits)  # type: ignore[misc]
    for i in state.instances:
        inst = self._instance(i.instance_id)
        inst.producer_id, inst.sequence, inst.retired = i.producer_id, i.sequence, retired_of(i)
        inst.dp_size = i.attention_dp_size
    canonical: list[int] = []
    for ws in state.workers:
        w = self._worker(self._instance(ws.instance_id), ws.rank)
        w.cursor, w.last_created, w.session_fresh = ws.cursor, ws.last_created, ws.session_fresh
        w.split_blocks, w.split_tail = ws.split_blocks, ws.split_tail
        w.reasons, w.gaps = list(ws.degraded_reasons), ws.gaps
        for win in ws.windows:
            slot = self._slot(w, win.window_size, True)
            self._slots[slot].capacity = None if win.capacity is None else list(win.capacity)
            canonical.append(slot)
    for i in state.instances:  # after the workers, which the state holds already degraded
        self._instance(i.instance_id).pending = list(i.pending_degraded)
    columns = _columns(state)
    engine, content, has_content, counts, holders = columns
    pos, prev = 0, -1
    for n, e in enumerate(engine):
        if e <= prev:  # the messages are the compiled core's
            raise ValueError(f"corrupt index state: block hashes not strictly ascending at node {n}")
        if not counts[n]:
            raise ValueError(f"corrupt index state: node {n} has no holder")
        prev = e
        node = self._nodes[e] = Node()
        if has_content[n]:
            self._set_content(e, node, content[n])
        last = -1
        for packed in holders[pos : pos + counts[n]]:
            if packed & SLOT_MAX <= last:
                raise ValueError(f"corrupt index state: holders of node {n} not in ascending slot order")
            last = packed & SLOT_MAX
            if last >= len(canonical):
                raise ValueError(f"corrupt index state: holder slot {last} of {len(canonical)}")
            slot = canonical[packed & SLOT_MAX]
            level, prio = (packed >> SLOT_BITS) & 0xF, packed >> 24
            node.holders[slot] = [level, prio]
            self._slots[slot].levels[level] += 1
            self._slots[slot].held.add(e)
        pos += counts[n]


def _columns(state: IndexState) -> tuple[array[int], array[int], array[int], array[int], array[int]]:
    """The node columns of ``state`` as arrays (checked for consistent lengths)."""
    engine, content, has_content, counts, holders = (
        array("Q", state.engine),
        array("Q", state.content),
        array("B", state.has_content),
        array("I", state.holder_counts),
        array("I", state.holders),
    )
    if sys.byteorder == "big":
        for col in (engine, content, counts, holders):
            col.byteswap()
    n = len(engine)
    if not len(content) == len(has_content) == len(counts) == n or sum(counts) != len(holders):
        raise ValueError(
            f"corrupt index state: {n} nodes but {len(content)} content hashes, {len(has_content)} flags, "
            f"{len(counts)} holder counts and {len(holders)} holders (expected {sum(counts)})"
        )
    return engine, content, has_content, counts, holders
