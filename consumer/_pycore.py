"""The pure-Python index core: the executable specification of the compiled one (``_indexcore``).

Both cores implement the same methods with the same results; ``CacheIndex`` wraps either.
This one keeps plain dicts (about ten times the memory of the compiled core's tables) and is
used when the extension is not built or ``KVEVENTS_PURE_PYTHON`` is set.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from typing import Any

from kvevents.schemas import (
    EventBatch,
    KVCacheCreatedData,
    KVCacheRemovedData,
    KVCacheStoredBlockData,
    KVCacheStoredData,
    KVCacheUpdatedData,
    decode_batch,
)
from kvevents.schemas.limits import (
    DEFAULT_LIMITS,
    BatchLimits,
    check_batch,
)

from . import _reasons
from ._pycore_model import (
    Instance,
    Node,
    Slot,
    Worker,
    add_pending,
    clamp_level,
    clamp_priority,
    retire_producer,
    retired_of,
)
from ._pycore_room import check_room
from ._pycore_state import export_state, import_state
from ._query_keys import U64_END, query_key
from ._state import (
    MAX_REASONS,
    SLOT_MAX,
    IndexState,
)
from .hashing import content_hash_of_block, content_hashes_for_tokens

__all__ = ["COUNTER_NAMES", "PyIndexCore", "retired_of"]

log = logging.getLogger("kvevents.consumer.index")

COUNTER_NAMES = (
    "batches_applied",
    "batches_replayed",
    "batches_stale",
    "events_applied",
    "events_duplicate",
    "blocks_stored",
    "blocks_removed",
    "orphan_blocks",
    "unknown_removed",
    "unknown_updated",
    "content_conflicts",
    "gaps",
    "resyncs",
    "session_conflicts",
)

_UNKNOWN = -1  # parent content not known (orphan chain); None means "root of a prefix"


class PyIndexCore:
    """Dict-based index core (see ``CacheIndex`` for the semantics)."""

    compiled = False

    def __init__(self, key_factory: Any = tuple, limits: BatchLimits | None = None) -> None:
        self._key_factory = key_factory
        self.limits = DEFAULT_LIMITS if limits is None else limits
        self._instances: dict[str, Instance] = {}
        self._nworkers = 0
        self._slots: list[Slot] = []
        self._widest = 0  # the most window caches a worker has had (check_room)
        self._nodes: dict[int, Node] = {}
        self._by_content: dict[int, set[int]] = {}
        self._counters = dict.fromkeys(COUNTER_NAMES, 0)

    # ------------------------------------------------------------------ workers and slots

    def _instance(self, instance_id: str) -> Instance:
        inst = self._instances.get(instance_id)
        if inst is None:
            inst = self._instances[instance_id] = Instance(instance_id)
        return inst

    def _worker(self, inst: Instance, rank: int) -> Worker:
        w = inst.workers.get(rank)
        if w is None:
            w = inst.workers[rank] = Worker(inst, rank)
            self._nworkers += 1
            for reason, below in inst.pending:  # degradations of every rank, made before it came
                if rank < below:
                    self._degrade(w, reason)
        return w

    def _find_worker(self, instance_id: str, rank: int) -> Worker | None:
        inst = self._instances.get(instance_id)
        return None if inst is None else inst.workers.get(rank)

    def _slot(self, w: Worker, window: int, create: bool) -> int:
        """The active slot of ``(w, window)``; -1 when absent and not ``create``."""
        slot = w.slots.get(window)
        if slot is not None:
            s = self._slots[slot]
            if s.active:
                return slot
            if not create:
                return -1
            s.active = True
            s.capacity = None
            return slot
        if not create:
            return -1
        slot = len(self._slots)
        if slot > SLOT_MAX:
            raise OverflowError(f"more than {SLOT_MAX} (worker, window size) caches in one index")
        self._slots.append(Slot(w, window))
        w.slots[window] = slot
        self._widest = max(self._widest, len(w.slots))
        return slot

    def _degrade(self, w: Worker, reason: str) -> None:
        if len(w.reasons) < MAX_REASONS:
            w.reasons.append(reason)
        w.gaps += 1
        w.last_created = False  # a Created event after a gap starts a new generation
        self._counters["gaps"] += 1

    # ------------------------------------------------------------------ block store

    def _add_holder(self, engine: int, node: Node, slot: int, level: int, priority: int) -> None:
        s = self._slots[slot]
        held = node.holders.get(slot)
        if held is None:
            node.holders[slot] = [level, priority]
            s.levels[level] += 1
            s.held.add(engine)
        else:
            s.levels[held[0]] -= 1
            s.levels[level] += 1
            held[0] = level
            held[1] = priority

    def _free_node_if_empty(self, engine: int, node: Node) -> None:
        if node.holders:
            return
        del self._nodes[engine]
        if node.content is not None:
            same = self._by_content[node.content]
            same.discard(engine)
            if not same:
                del self._by_content[node.content]

    def _remove_holder(self, engine: int, slot: int) -> bool:
        node = self._nodes.get(engine)
        if node is None:
            return False
        held = node.holders.pop(slot, None)
        if held is None:
            return False
        s = self._slots[slot]
        s.levels[held[0]] -= 1
        s.held.discard(engine)
        self._free_node_if_empty(engine, node)
        return True

    def _clear_slot(self, slot: int) -> None:
        for engine in list(self._slots[slot].held):
            self._remove_holder(engine, slot)

    def _drop_worker_windows(self, w: Worker) -> None:
        for slot in w.slots.values():
            s = self._slots[slot]
            if s.active:
                if any(s.levels):
                    self._clear_slot(slot)
                s.active = False
                s.capacity = None

    def _set_content(self, engine: int, node: Node, content: int) -> None:
        node.content = content
        self._by_content.setdefault(content, set()).add(engine)

    def _store(
        self, slot: int, parent: int | None, blocks: Sequence[KVCacheStoredBlockData], start: int
    ) -> None:
        """Store ``blocks[start:]`` in ``slot``, the first one a child of engine hash ``parent``."""
        if parent is None:
            parent_content: int | None = None
        else:
            pnode = self._nodes.get(parent)
            parent_content = _UNKNOWN if pnode is None or pnode.content is None else pnode.content
        counters = self._counters
        for i in range(start, len(blocks)):
            block = blocks[i]
            if not block.tokens:  # a placeholder (vLLM's offloading connector): no content
                parent_content = _UNKNOWN
            content = None if parent_content == _UNKNOWN else content_hash_of_block(parent_content, block)
            node = self._nodes.get(block.block_hash)
            if node is None:
                node = self._nodes[block.block_hash] = Node()
            if node.content is None:
                if content is not None:
                    self._set_content(block.block_hash, node, content)
            elif content is not None and content != node.content:
                counters["content_conflicts"] += 1
            self._add_holder(
                block.block_hash, node, slot, clamp_level(block.cache_level), clamp_priority(block.priority)
            )
            if node.content is None:
                counters["orphan_blocks"] += 1
            parent_content = (
                content if content is not None else (node.content if node.content is not None else _UNKNOWN)
            )
        counters["blocks_stored"] += max(0, len(blocks) - start)

    # ------------------------------------------------------------------ applying batches

    def apply_encoded(self, data: bytes | bytearray | memoryview) -> None:
        self.apply_batch(decode_batch(data))

    def apply_encoded_many(self, batches: Sequence[bytes | bytearray | memoryview]) -> int:
        for done, data in enumerate(batches):
            try:
                self.apply_encoded(data)
            except Exception as exc:
                exc.add_note(f"apply_encoded_many: batch {done} (the {done} before it are applied)")
                raise
        return len(batches)

    def apply_batch(self, batch: EventBatch) -> None:
        check_batch(batch, self.limits)  # before anything changes: a rejected batch leaves no trace
        check_room(self, batch)
        counters = self._counters
        inst = self._instance(batch.instance_id)
        pid, seq = batch.producer_id, batch.sequence
        replay = False
        if inst.producer_id is None:
            inst.producer_id, inst.sequence = pid, seq
        elif pid != inst.producer_id:
            if pid in inst.retired:
                if seq > inst.retired[pid]:
                    self._session_conflict(inst, pid, seq)
                else:
                    counters["batches_stale"] += 1
                return
            retire_producer(inst.retired, inst.producer_id, inst.sequence)
            inst.producer_id, inst.sequence = pid, seq
            for w in inst.workers.values():
                w.session_fresh = True
                w.last_created = False
            if seq != 0:
                reason = _reasons.new_session_not_at_zero(pid, seq)
                self._degrade_all(inst, batch.attention_dp_size, reason)
        elif seq <= inst.sequence:
            replay = True
        else:
            if seq > inst.sequence + 1:
                reason = _reasons.batches_lost(pid, inst.sequence, seq)
                self._degrade_all(inst, batch.attention_dp_size, reason)
            inst.sequence = seq
        if replay:
            counters["batches_replayed"] += 1
        else:
            inst.dp_size = batch.attention_dp_size
            for drop in batch.dropped:
                if drop.dropped_events > 0:
                    w = self._worker(inst, drop.attention_dp_rank)
                    self._degrade(w, _reasons.events_dropped(drop.dropped_events, seq))
        counters["batches_applied"] += 1
        offset = batch.first_event_block_offset
        for k, event in enumerate(batch.events):
            rank = event.attention_dp_rank or 0
            self._apply_event(self._worker(inst, rank), event, offset if k == 0 else 0)

    def _session_conflict(self, inst: Instance, pid: int, seq: int) -> None:
        """A retired producer sent a new batch: two live producers share the instance id."""
        inst.retired[pid] = seq
        self._counters["session_conflicts"] += 1
        reason = _reasons.session_conflict(pid, seq, inst.producer_id or 0)
        log.warning("instance %r: %s", inst.instance_id, reason)
        self._degrade_all(inst, inst.dp_size, reason)

    def _degrade_all(self, inst: Instance, dp_size: int, reason: str) -> None:
        """Every worker of ``inst``, and every rank below ``dp_size`` not seen yet when it first
        appears (a worker made now for each would let one small batch make 1,024 of them)."""
        for rank in sorted(inst.workers):
            self._degrade(inst.workers[rank], reason)
        below = max(dp_size, 1)
        if sum(1 for rank in inst.workers if rank < below) < below:
            add_pending(inst.pending, reason, below)

    def _apply_event(self, w: Worker, event: Any, offset: int) -> None:
        data = event.data
        cls = data.__class__
        is_created = cls is KVCacheCreatedData
        is_stored = cls is KVCacheStoredData
        if not is_stored:
            offset = 0
        event_id = event.event_id
        start = 0
        tail_parent = False
        if w.session_fresh:
            w.session_fresh = False
            if not is_created and not (offset == 0 and event_id == (0 if w.cursor is None else w.cursor + 1)):
                if w.cursor is None:
                    self._degrade(w, _reasons.joined_mid_stream(event_id))
                else:
                    pid = w.instance.producer_id or 0
                    self._degrade(w, _reasons.new_session_not_continuous(pid, w.cursor, event_id))
        else:
            cursor = w.cursor if w.cursor is not None else -1
            if event_id < cursor:
                self._counters["events_duplicate"] += 1
                return
            if event_id == cursor:
                if offset > 0 and w.split_blocks > 0:
                    if offset <= w.split_blocks:
                        start = w.split_blocks - offset
                        if start >= len(data.blocks):
                            self._counters["events_duplicate"] += 1
                            return
                        tail_parent = True
                    else:
                        self._degrade(w, _reasons.missing_fragment(event_id, offset, w.split_blocks))
                else:
                    self._counters["events_duplicate"] += 1
                    return
            elif event_id == cursor + 1:
                if offset > 0:
                    self._degrade(w, _reasons.missing_fragment(event_id, offset, 0))
            else:
                self._degrade(w, _reasons.event_ids_jumped(cursor, event_id))
        self._counters["events_applied"] += 1
        window = event.window_size
        if is_stored:
            slot = self._slot(w, window, True)
            parent = w.split_tail if tail_parent else data.parent_hash
            self._store(slot, parent, data.blocks, start)
            if data.blocks:
                w.split_blocks = offset + len(data.blocks)
                w.split_tail = data.blocks[-1].block_hash
            else:
                w.split_blocks, w.split_tail = 0, None
        else:
            w.split_blocks, w.split_tail = 0, None
            if is_created:
                if not w.last_created:
                    self._drop_worker_windows(w)
                    w.reasons.clear()
                    w.gaps = 0
                    if data.snapshot:
                        self._counters["resyncs"] += 1
                slot = self._slot(w, window, True)
                if any(self._slots[slot].levels):
                    self._clear_slot(slot)
                self._slots[slot].capacity = list(data.num_blocks_per_cache_level)
            elif cls is KVCacheRemovedData:
                slot = self._slot(w, window, False)
                for engine in data.block_hashes:
                    if slot >= 0 and self._remove_holder(engine, slot):
                        self._counters["blocks_removed"] += 1
                    else:
                        self._counters["unknown_removed"] += 1
            elif cls is KVCacheUpdatedData:
                self._update(w, window, data)
        w.cursor = event_id
        w.last_created = is_created

    def _update(self, w: Worker, window: int, data: KVCacheUpdatedData) -> None:
        slot = self._slot(w, window, False)
        node = self._nodes.get(data.block_hash) if slot >= 0 else None
        held = None if node is None else node.holders.get(slot)
        if held is None:
            self._counters["unknown_updated"] += 1
            return
        if data.cache_level is not None:
            level = clamp_level(data.cache_level.new_value)
            levels = self._slots[slot].levels
            levels[held[0]] -= 1
            levels[level] += 1
            held[0] = level
        if data.priority is not None:
            held[1] = clamp_priority(data.priority.new_value)

    # ------------------------------------------------------------------ queries

    def content_hashes(
        self,
        tokens: Sequence[int],
        block_size: int,
        lora_id: int | None,
        cache_salt: str | None,
        token_extra_ids: Sequence[int] | None,
        mm_keys: Sequence[Sequence[Any]] | None,
    ) -> list[int]:
        return content_hashes_for_tokens(
            tokens,
            block_size,
            lora_id,
            cache_salt=cache_salt,
            token_extra_ids=token_extra_ids,
            mm_keys=mm_keys,
        )

    def _holders_of(self, key: int, by_content: bool) -> Iterable[tuple[int, list[int]]]:
        if not by_content:
            node = self._nodes.get(key)
            return () if node is None else node.holders.items()
        engines = self._by_content.get(key)
        if not engines:
            return ()
        return [item for engine in sorted(engines) for item in self._nodes[engine].holders.items()]

    def match(
        self, hashes: Sequence[int], by_content: bool, window: int | None, max_level: int
    ) -> list[tuple[int, int, int]]:
        """Per slot holding ``hashes[0]``: (slot, blocks of the contiguous run, primary ones)."""
        score: dict[int, list[int]] = {}  # slot -> [run length, primary blocks, step of primary mark]
        slots = self._slots
        for i, key in enumerate(hashes):
            if type(key) is not int or not 0 <= key < U64_END:
                key = query_key(i, key)
            extended = False
            for slot, (level, _) in self._holders_of(key, by_content):
                if level > max_level or (window is not None and slots[slot].window != window):
                    continue
                entry = score.get(slot)
                if i == 0 and entry is None:
                    score[slot] = [1, 1 if level == 0 else 0, 1 if level == 0 else -1]
                    extended = True
                elif entry is not None and entry[0] == i:
                    entry[0] = i + 1
                    if level == 0:
                        entry[1] += 1
                        entry[2] = i + 1
                    extended = True
                elif entry is not None and entry[0] == i + 1 and level == 0 and entry[2] != i + 1:
                    entry[1] += 1  # the same content held twice by one slot: the primary copy counts
                    entry[2] = i + 1
            if not extended:
                break
        return sorted((slot, e[0], e[1]) for slot, e in score.items())

    def match_counts(
        self, hashes: Sequence[int], by_content: bool, window: int | None, max_level: int
    ) -> dict[Any, int]:
        """{worker key: best run over its window caches}."""
        out: dict[Any, int] = {}
        for slot, run, _ in self.match(hashes, by_content, window, max_level):
            w = self._slots[slot].worker
            key = self._key_factory(w.instance.instance_id, w.rank)
            if out.get(key, 0) < run:
                out[key] = run
        return out

    # ------------------------------------------------------------------ introspection

    def slot_key(self, slot: int) -> tuple[str, int, int]:
        s = self._slots[slot]
        return s.worker.instance.instance_id, s.worker.rank, s.window

    def workers(self) -> list[tuple[str, int]]:
        return sorted((i.instance_id, r) for i in self._instances.values() for r in i.workers)

    def degraded_workers(self) -> list[tuple[str, int]]:
        return [(i.instance_id, r) for i in self._instances.values() for r, w in i.workers.items() if w.gaps]

    def instance_ids(self) -> list[str]:
        return list(self._instances)

    def worker_count(self) -> int:
        return self._nworkers

    def instance_workers(self, instance_ids: Iterable[str]) -> list[tuple[str, int]]:
        found = (self._instances.get(i) for i in instance_ids)
        return [(inst.instance_id, r) for inst in found if inst is not None for r in inst.workers]

    def worker_info(self, instance_id: str, rank: int) -> dict[str, Any] | None:
        w = self._find_worker(instance_id, rank)
        if w is None:
            return None
        windows = {}
        for window, slot in sorted(w.slots.items()):
            s = self._slots[slot]
            if s.active:
                windows[window] = (
                    {lvl: n for lvl, n in enumerate(s.levels) if n},
                    None if s.capacity is None else tuple(s.capacity),
                )
        inst = w.instance
        return {
            "reasons": tuple(w.reasons),
            "gaps": w.gaps,
            "cursor": w.cursor,
            "producer_id": inst.producer_id,
            "sequence": None if inst.producer_id is None else inst.sequence,
            "windows": windows,
        }

    def worker_blocks(
        self, instance_id: str, rank: int, window: int
    ) -> list[tuple[int, int | None, int, int]]:
        w = self._find_worker(instance_id, rank)
        slot = -1 if w is None else self._slot(w, window, False)
        if slot < 0:
            return []
        out = []
        for engine in self._slots[slot].held:
            node = self._nodes[engine]
            held = node.holders[slot]
            out.append((engine, node.content, held[0], held[1]))
        out.sort()
        return out

    def counters(self) -> dict[str, int]:
        return dict(self._counters)

    def held_blocks(self) -> int:
        """Worker-block pairs held (a block held by k caches counts k times)."""
        return sum(len(n.holders) for n in self._nodes.values())

    def node_count(self) -> int:
        return len(self._nodes)

    def memory_bytes(self) -> int:
        """A rough estimate: measured dict and object sizes of this layout, not a walk (a holder:
        its entry in the node's dict and in its slot's set of held nodes)."""
        holders = self.held_blocks()
        return (
            64 + 250 * len(self._nodes) + 165 * holders + 120 * len(self._by_content) + 400 * len(self._slots)
        )

    # ------------------------------------------------------------------ seams for snapshots

    def reset_worker(self, instance_id: str, rank: int, clear_degraded: bool) -> None:
        w = self._worker(self._instance(instance_id), rank)
        self._drop_worker_windows(w)
        w.split_blocks, w.split_tail = 0, None
        if clear_degraded:
            w.reasons.clear()
            w.gaps = 0

    def reset_workers(self, keys: Iterable[tuple[str, int]], clear_degraded: bool) -> None:
        for instance_id, rank in keys:
            self.reset_worker(instance_id, rank, clear_degraded)

    def mark_degraded(self, instance_id: str, rank: int, reason: str) -> None:
        self._degrade(self._worker(self._instance(instance_id), rank), reason)

    def mark_instance_degraded(self, instance_id: str, reason: str) -> int:
        inst = self._instances.get(instance_id)
        if inst is None:
            return 0
        for rank in sorted(inst.workers):
            self._degrade(inst.workers[rank], reason)
        return len(inst.workers)

    def load_window(
        self, instance_id: str, rank: int, window: int, capacity: Sequence[int] | None, stored: Iterable[Any]
    ) -> None:
        w = self._worker(self._instance(instance_id), rank)
        slot = self._slot(w, window, True)
        if capacity is not None:
            self._slots[slot].capacity = list(capacity)
        for data in stored:
            self._store(slot, data.parent_hash, data.blocks, 0)

    def set_cursor(self, instance_id: str, rank: int, event_id: int | None) -> None:
        w = self._worker(self._instance(instance_id), rank)
        w.cursor = event_id
        w.session_fresh = event_id is None
        w.last_created = False
        w.split_blocks, w.split_tail = 0, None

    # ------------------------------------------------------------------ state

    def export_state(self) -> IndexState:
        return export_state(self)

    def import_state(self, state: IndexState) -> None:
        """Replace everything with ``state`` (counters start from zero)."""
        import_state(self, state)
