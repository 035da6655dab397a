"""Test helpers for the engine simulator: a recording event manager and a naive replay model.

``RecordingEventManager`` keeps every ``enqueue_*`` call and ``flush`` in order. ``ReplayModel``
applies those calls to a plain dict per window size, checking on the way that the stream is
self-consistent (a Stored block's parent is held, nothing is stored twice, only held leaves are
removed, every Updated diff starts from the value the model holds), so that comparing it with
the simulator's ground truth at each flush proves the events say exactly what the cache did.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvevents.schemas import (
    KVCacheCreatedData,
    KVCacheEvent,
    KVCacheRemovedData,
    KVCacheStoredData,
    KVCacheUpdatedData,
)


@dataclass
class RecordingEventManager:
    """Records calls as tuples: ("created", levels, w), ("stored", blocks, w), ("removed", hash, w),
    ("updated", data, w) and ("flush",). ``on_flush`` is called after each flush is recorded."""

    calls: list[tuple] = field(default_factory=list)
    on_flush: Any = None

    def enqueue_created_event(self, num_blocks_per_cache_level: list[int], window_size: int) -> None:
        self.calls.append(("created", list(num_blocks_per_cache_level), window_size))

    def enqueue_stored_event(self, blocks: list[Any], window_size: int) -> None:
        self.calls.append(("stored", list(blocks), window_size))

    def enqueue_removed_event(self, block_hash: int, window_size: int) -> None:
        self.calls.append(("removed", block_hash, window_size))

    def enqueue_updated_event(self, data: KVCacheUpdatedData, window_size: int) -> None:
        self.calls.append(("updated", data, window_size))

    def flush(self) -> None:
        self.calls.append(("flush",))
        if self.on_flush is not None:
            self.on_flush()

    def of_kind(self, kind: str, since: int = 0) -> list[tuple]:
        """The calls of one kind, from index ``since`` on (see :meth:`mark`)."""
        return [c for c in self.calls[since:] if c[0] == kind]

    def mark(self) -> int:
        """A position in the recording, for ``of_kind(kind, since=mark)``."""
        return len(self.calls)


@dataclass
class _ModelBlock:
    parent: int | None
    level: int
    priority: int
    tokens: tuple[int, ...]
    lora_id: int | None


class ReplayModel:
    """A naive per-window dict of held blocks, rebuilt from recorded calls only."""

    def __init__(self) -> None:
        self.windows: dict[int, dict[int, _ModelBlock]] = {}
        self.children: dict[int, dict[int, int]] = {}
        self.capacity: dict[int, list[int]] = {}
        self.applied = 0

    def apply(self, calls: list[tuple]) -> None:
        """Apply the recorded calls not applied yet (see :class:`RecordingEventManager`)."""
        for call in calls[self.applied :]:
            kind = call[0]
            if kind == "created":
                self.created(call[2], call[1])
            elif kind == "stored":
                infos = call[1]
                assert infos, "empty Stored event"
                blocks = [
                    (i.block_hash, 0 if i.is_primary else 1, i.priority, tuple(i.tokens), i.lora_id)
                    for i in infos
                ]
                prevs = [i.prev_block_hash for i in infos]
                assert prevs[1:] == [b[0] for b in blocks[:-1]], "Stored blocks are not a chain"
                self.stored(call[2], prevs[0], blocks)
            elif kind == "removed":
                self.removed(call[2], call[1])
            elif kind == "updated":
                self.updated(call[2], call[1])
            else:
                assert kind == "flush", f"unknown call {kind}"
        self.applied = len(calls)

    def apply_events(self, events: list[KVCacheEvent]) -> None:
        """Apply events as a ``KVCacheEventManager`` delivers them."""
        for event in events:
            data, window = event.data, event.window_size
            if isinstance(data, KVCacheCreatedData):
                self.created(window, list(data.num_blocks_per_cache_level))
            elif isinstance(data, KVCacheStoredData):
                blocks = [
                    (b.block_hash, b.cache_level, b.priority, tuple(b.tokens), b.lora_id) for b in data.blocks
                ]
                self.stored(window, data.parent_hash, blocks)
            elif isinstance(data, KVCacheRemovedData):
                for h in data.block_hashes:
                    self.removed(window, h)
            else:
                self.updated(window, data)

    def created(self, window: int, levels: list[int]) -> None:
        self.windows[window] = {}
        self.children[window] = {}
        self.capacity[window] = levels

    def _window(self, window: int) -> tuple[dict[int, _ModelBlock], dict[int, int]]:
        assert window in self.windows, f"event for window {window} before its Created event"
        return self.windows[window], self.children[window]

    def stored(self, window: int, parent: int | None, blocks: list[tuple]) -> None:
        held, children = self._window(window)
        assert blocks, "empty Stored event"
        for block_hash, level, priority, tokens, lora_id in blocks:
            assert parent is None or parent in held, f"Stored block's parent {parent} is not held"
            assert block_hash not in held, f"block {block_hash} stored twice"
            held[block_hash] = _ModelBlock(parent, level, priority, tokens, lora_id)
            if parent is not None:
                children[parent] = children.get(parent, 0) + 1
            parent = block_hash

    def removed(self, window: int, block_hash: int) -> None:
        held, children = self._window(window)
        assert block_hash in held, f"removed block {block_hash} is not held"
        assert not children.get(block_hash), f"block {block_hash} removed before its children"
        parent = held.pop(block_hash).parent
        if parent is not None:
            children[parent] -= 1

    def updated(self, window: int, data: KVCacheUpdatedData) -> None:
        held, _ = self._window(window)
        b = held.get(data.block_hash)
        assert b is not None, f"updated block {data.block_hash} is not held"
        if data.cache_level is not None:
            assert data.cache_level.old_value == b.level, "cache level diff starts from a wrong level"
            b.level = data.cache_level.new_value
        if data.priority is not None:
            assert data.priority.old_value == b.priority, "priority diff starts from a wrong priority"
            b.priority = data.priority.new_value

    def held(self, window: int) -> dict[int, tuple]:
        """hash → (parent, level, priority, tokens, lora_id): comparable with the ground truth."""
        return {
            h: (b.parent, b.level, b.priority, b.tokens, b.lora_id) for h, b in self.windows[window].items()
        }

    def count(self, window: int, level: int) -> int:
        return sum(1 for b in self.windows[window].values() if b.level == level)


def truth_tuples(held: dict[int, Any]) -> dict[int, tuple]:
    """A cache's ``held_blocks()`` in :meth:`ReplayModel.held`'s shape."""
    return {h: (b.parent_hash, b.cache_level, b.priority, b.tokens, b.lora_id) for h, b in held.items()}
