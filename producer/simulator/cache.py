"""A simulated paged KV-cache block manager that emits the events an engine would.

:class:`PagedBlockCache` models TensorRT-LLM's ``WindowBlockManager`` (one per window size):
primary and secondary levels, prefix reuse of full blocks, two Stored events per request,
eviction of low-priority LRU leaves with offload to secondary memory. The model, its fidelity
to TensorRT-LLM and its deliberate simplifications: ``docs/SIMULATOR.md``.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import xxhash
from kvevents.producer.block import BlockInfo
from kvevents.schemas import (
    DEFAULT_PRIORITY,
    PRIMARY_LEVEL,
    SECONDARY_LEVEL,
    KVCacheEventDiff,
    KVCacheUpdatedData,
)

from .blocks import (
    HeldBlock,
    RetentionRange,
    block_hashes,
    chained_block_hash,
    retention_priorities,
    to_token_array,
)
from .eviction import CachedBlock, EvictionQueue

__all__ = [
    "DEFAULT_OFFLOAD_MIN_PRIORITY",
    "DEFAULT_WINDOW_SIZE",
    "CacheFullError",
    "CacheStats",
    "HeldBlock",
    "KVEventSink",
    "PagedBlockCache",
    "RetentionRange",
    "block_hashes",
    "chained_block_hash",
    "to_token_array",
]

DEFAULT_WINDOW_SIZE = 8192
"""Attention window size used when the caller names none (one window size per cache)."""
DEFAULT_OFFLOAD_MIN_PRIORITY = 30
"""TensorRT-LLM's default ``secondary_offload_min_priority``: lower-priority victims are dropped."""

_OFFLOAD = KVCacheEventDiff(PRIMARY_LEVEL, SECONDARY_LEVEL)
_ONBOARD = KVCacheEventDiff(SECONDARY_LEVEL, PRIMARY_LEVEL)
"""The two level changes, shared by every Updated event that carries one (immutable)."""
_FAST_HASH = sys.byteorder == "little"
"""A block's hash straight from its token array's buffer (no LoRA id): ``chained_block_hash``."""
_xxh3 = xxhash.xxh3_64_intdigest


class KVEventSink(Protocol):
    """What the cache calls on a ``KVCacheEventManager`` (the enqueue side of its public API)."""

    def enqueue_created_event(self, num_blocks_per_cache_level: list[int], window_size: int) -> None: ...

    def enqueue_stored_event(self, blocks: list[Any], window_size: int) -> None: ...

    def enqueue_removed_event(self, block_hash: int, window_size: int) -> None: ...

    def enqueue_updated_event(self, data: KVCacheUpdatedData, window_size: int) -> None: ...


@dataclass(slots=True)
class CacheStats:
    """Counters of one cache (one window size). Event counters count ``enqueue_*`` calls."""

    sequences_added: int = 0
    matchable_blocks: int = 0
    """Full blocks of ``prompt[:-1]`` over all admitted requests (the most that could hit)."""
    hit_blocks: int = 0
    """Blocks reused from the cache at admission (prefix-cache hits)."""
    stored_events: int = 0
    stored_blocks: int = 0
    adopted_blocks: int = 0
    """Blocks another request cached first: the private copy was dropped, no Stored event."""
    removed_blocks: int = 0
    evictions: int = 0
    """Victims taken from primary memory (each then offloaded or removed)."""
    offloads: int = 0
    onboards: int = 0
    priority_updates: int = 0
    created_events: int = 0

    @property
    def updated_events(self) -> int:
        return self.offloads + self.onboards + self.priority_updates


class CacheFullError(RuntimeError):
    """A request does not fit: every primary slot is referenced by running requests."""


@dataclass(slots=True)
class _Sequence:
    lora_id: int | None
    retention: Sequence[RetentionRange]
    blocks: list[CachedBlock] = field(default_factory=list)
    private: int = 0


class PagedBlockCache:
    """One window size's paged KV cache: allocation, prefix reuse, eviction, offload, events.

    The engine calls, per request: :meth:`can_admit`, :meth:`add_sequence` (reuse + allocate),
    :meth:`store_blocks` after the context phase and again with prompt + output when it
    finishes, then :meth:`release`. Events go to ``events`` (a ``KVCacheEventManager`` or
    anything with its ``enqueue_*`` methods); the caller flushes it once per iteration.
    ``block_info`` builds the objects handed to ``enqueue_stored_event`` (the producer's
    :class:`~kvevents.producer.block.BlockInfo` by default; positional arguments
    ``(block_hash, prev_block_hash, tokens, lora_id, is_primary, priority)``).
    """

    def __init__(
        self,
        *,
        block_size: int,
        num_primary_blocks: int,
        num_secondary_blocks: int = 0,
        window_size: int = DEFAULT_WINDOW_SIZE,
        events: KVEventSink | None = None,
        offload_min_priority: int = DEFAULT_OFFLOAD_MIN_PRIORITY,
        block_info: Callable[..., Any] | None = None,
    ) -> None:
        for name, value, minimum in (
            ("block_size", block_size, 1),
            ("num_primary_blocks", num_primary_blocks, 1),
            ("num_secondary_blocks", num_secondary_blocks, 0),
            ("window_size", window_size, 1),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
        self.block_size = block_size
        self.window_size = window_size
        self.num_primary_blocks = num_primary_blocks
        self.num_secondary_blocks = num_secondary_blocks
        self.offload_min_priority = offload_min_priority
        self._events = events
        self._block_info = BlockInfo if block_info is None else block_info
        self._blocks: dict[int, CachedBlock] = {}
        self._seqs: dict[object, _Sequence] = {}
        self._used = [0, 0]  # slots in use per level (primary includes private blocks)
        self._private = 0  # primary slots held by running requests' unidentified blocks
        self._referenced_primary = 0  # cached primary blocks with ref_count > 0
        self._evictable = EvictionQueue(compact_above=4 * (num_primary_blocks + num_secondary_blocks) + 64)
        self._tick = 0
        self.stats = CacheStats()

    # ------------------------------------------------------------------ queries

    @property
    def num_blocks_per_cache_level(self) -> list[int]:
        """Capacity per level, as the Created event carries it."""
        return [self.num_primary_blocks, self.num_secondary_blocks]

    def num_cached(self, level: int | None = None) -> int:
        """Cached (identified) blocks, at one level or in total."""
        if level is None:
            return len(self._blocks)
        return self._used[level] - (self._private if level == PRIMARY_LEVEL else 0)

    @property
    def num_private(self) -> int:
        """Primary slots held by running requests' blocks that are not (yet) cached."""
        return self._private

    @property
    def num_running(self) -> int:
        return len(self._seqs)

    def blocks_needed(self, prompt_len: int, max_new_tokens: int) -> int:
        """Blocks one request occupies while it runs (prompt + output, the last one partial)."""
        return -(-(prompt_len + max_new_tokens) // self.block_size)

    def match_hashes(self, hashes: Iterable[int]) -> int:
        """How many leading hashes of a chain the cache holds (any level)."""
        blocks = self._blocks
        count = 0
        for h in hashes:
            if h not in blocks:
                break
            count += 1
        return count

    def match(self, tokens: Sequence[int], lora_id: int | None = None) -> int:
        """How many leading full blocks of ``tokens`` the cache holds now (any level).

        No side effect. The engine reuses at most ``(len(prompt) - 1) // block_size`` blocks
        of a prompt, since the last prompt token is always recomputed.
        """
        arr = to_token_array(tokens)
        bs = self.block_size
        blocks = self._blocks
        parent: int | None = None
        count = 0
        for i in range(len(arr) // bs):
            parent = chained_block_hash(parent, arr[i * bs : (i + 1) * bs], lora_id)
            if parent not in blocks:
                break
            count += 1
        return count

    def held_blocks(self) -> dict[int, HeldBlock]:
        """Every cached block: hash → (parent, level, priority, tokens, LoRA id)."""
        return {
            h: HeldBlock(
                block_hash=h,
                parent_hash=None if b.parent is None else b.parent.block_hash,
                cache_level=b.level,
                priority=b.priority,
                tokens=tuple(b.tokens),
                lora_id=b.lora_id,
            )
            for h, b in self._blocks.items()
        }

    def snapshot_blocks(self) -> list[Any]:
        """Every cached block as the object ``enqueue_stored_event`` takes (``block_info``):
        what :meth:`KVCacheEventManager.enqueue_snapshot` needs for this window size."""
        make = self._block_info
        return [
            make(
                h,
                None if b.parent is None else b.parent.block_hash,
                b.tokens,
                b.lora_id,
                b.level == PRIMARY_LEVEL,
                b.priority,
            )
            for h, b in self._blocks.items()
        ]

    # ------------------------------------------------------------------ engine calls

    def emit_created(self) -> None:
        """The Created event an engine sends when it builds this cache."""
        if self._events is not None:
            self._events.enqueue_created_event(self.num_blocks_per_cache_level, self.window_size)
        self.stats.created_events += 1

    def _prompt_hashes(
        self, prompt: array[int], lora_id: int | None, hashes: Sequence[int] | None
    ) -> Sequence[int]:
        limit = max(len(prompt) - 1, 0) // self.block_size
        if hashes is None:
            return block_hashes(prompt, self.block_size, lora_id, max_blocks=limit)
        return hashes[:limit]

    def _slots_needed(self, matched: Sequence[CachedBlock], total_blocks: int) -> tuple[int, int]:
        """(primary slots the request needs, slots it may take from the evictable pool)."""
        onboards = sum(1 for b in matched if b.level != PRIMARY_LEVEL)
        unreferenced_matched = sum(1 for b in matched if b.level == PRIMARY_LEVEL and b.ref_count == 0)
        needed = total_blocks - len(matched) + onboards
        available = self.num_primary_blocks - self._referenced_primary - self._private - unreferenced_matched
        return needed, available

    def _matched(self, hashes: Sequence[int]) -> list[CachedBlock]:
        matched: list[CachedBlock] = []
        blocks = self._blocks
        for h in hashes:
            b = blocks.get(h)
            if b is None:
                break
            matched.append(b)
        return matched

    def can_admit(
        self,
        prompt: Sequence[int],
        max_new_tokens: int,
        lora_id: int | None = None,
        *,
        hashes: Sequence[int] | None = None,
    ) -> bool:
        """Whether :meth:`add_sequence` would succeed now (evicting unreferenced blocks)."""
        arr = to_token_array(prompt)
        matched = self._matched(self._prompt_hashes(arr, lora_id, hashes))
        needed, available = self._slots_needed(matched, self.blocks_needed(len(arr), max_new_tokens))
        return needed <= available

    def add_sequence(
        self,
        request_id: object,
        prompt: Sequence[int],
        max_new_tokens: int,
        lora_id: int | None = None,
        *,
        retention: Sequence[RetentionRange] = (),
        hashes: Sequence[int] | None = None,
    ) -> int:
        """Admit a request: reuse its cached prefix, reserve its other blocks; return the hits.

        ``hashes`` may pass the prompt's precomputed :func:`block_hashes` (same block size and
        LoRA id). Raises :class:`CacheFullError` when the request does not fit and
        ``ValueError`` for a request id already running.
        """
        if request_id in self._seqs:
            raise ValueError(f"request {request_id!r} is already running in this cache")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        arr = to_token_array(prompt)
        if not arr:
            raise ValueError("a request needs at least one prompt token")
        prompt_hashes = self._prompt_hashes(arr, lora_id, hashes)
        matched = self._matched(prompt_hashes)
        total_blocks = self.blocks_needed(len(arr), max_new_tokens)
        needed, available = self._slots_needed(matched, total_blocks)
        if needed > available:
            raise CacheFullError(
                f"request {request_id!r} needs {needed} primary blocks, only {available} can be freed "
                f"(window {self.window_size}, {self.num_primary_blocks} primary blocks)"
            )
        seq = _Sequence(lora_id=lora_id, retention=retention)
        self._seqs[request_id] = seq
        stats = self.stats
        stats.sequences_added += 1
        stats.matchable_blocks += len(prompt_hashes)
        stats.hit_blocks += len(matched)
        # Reference the whole reused prefix first, so no eviction below can take any of it.
        for b in matched:
            if b.ref_count == 0 and b.level == PRIMARY_LEVEL:
                self._referenced_primary += 1
            b.ref_count += 1
        priorities = retention_priorities(retention, self.block_size, 0, len(matched)) if retention else None
        for i, b in enumerate(matched):
            priority = None if priorities is None else priorities[i]
            if priority is not None and priority != b.priority:
                self._emit_updated(b.block_hash, priority=KVCacheEventDiff(b.priority, priority))
                b.priority = priority
                stats.priority_updates += 1
            if b.level != PRIMARY_LEVEL:
                self._onboard(b)
        seq.blocks = matched
        new_blocks = total_blocks - len(matched)
        for _ in range(new_blocks):
            self._make_primary_room()
            self._used[PRIMARY_LEVEL] += 1
        seq.private = new_blocks
        self._private += new_blocks
        return len(matched)

    def store_blocks(self, request_id: object, tokens: Sequence[int]) -> int:
        """Cache the full blocks of ``tokens`` (a running request's sequence whose KV state is
        computed) beyond those the request already holds; return how many were newly cached
        (blocks found already cached are adopted and not counted).

        Emits one Stored event for the new blocks (parent: the block before the first one).
        """
        seq = self._seqs.get(request_id)
        if seq is None:
            raise KeyError(f"request {request_id!r} is not running in this cache")
        arr = to_token_array(tokens)
        bs = self.block_size
        full = len(arr) // bs
        start = len(seq.blocks)
        if full <= start:
            return 0
        if full - start > seq.private:
            raise ValueError(
                f"request {request_id!r} stores {full - start} blocks but reserved only {seq.private} "
                f"(sequence longer than prompt + max_new_tokens?)"
            )
        parent = seq.blocks[-1] if seq.blocks else None
        blocks = self._blocks
        lora_id = seq.lora_id
        stored: list[CachedBlock] = []
        stored_parent = parent
        newly_stored = 0
        fast_hash = _FAST_HASH and lora_id is None
        priorities = retention_priorities(seq.retention, bs, start, full) if seq.retention else None
        for i in range(start, full):
            block_tokens = arr[i * bs : (i + 1) * bs]
            if fast_hash:  # chained_block_hash, inline
                h = _xxh3(block_tokens, seed=0 if parent is None else parent.block_hash)
            else:
                h = chained_block_hash(None if parent is None else parent.block_hash, block_tokens, lora_id)
            seq.private -= 1
            self._private -= 1
            existing = blocks.get(h)
            if existing is not None:
                if stored:  # cannot happen without a hash collision; keep events consistent anyway
                    self._emit_stored(stored, stored_parent)
                    stored = []
                self._adopt(existing)
                seq.blocks.append(existing)
                parent = stored_parent = existing
                continue
            priority = None if priorities is None else priorities[i - start]
            b = CachedBlock(
                h, parent, block_tokens, lora_id, DEFAULT_PRIORITY if priority is None else priority
            )
            b.ref_count = 1
            blocks[h] = b
            if parent is not None:
                parent.children[b] = None
                parent.primary_children += 1
            self._referenced_primary += 1
            seq.blocks.append(b)
            stored.append(b)
            newly_stored += 1
            parent = b
        if stored:
            self._emit_stored(stored, stored_parent)
        return newly_stored

    def release(self, request_id: object) -> None:
        """Finish a request: drop its references (leaf first) and free its private blocks."""
        seq = self._seqs.pop(request_id, None)
        if seq is None:
            raise KeyError(f"request {request_id!r} is not running in this cache")
        for b in reversed(seq.blocks):
            b.ref_count -= 1
            if b.ref_count == 0:
                self._referenced_primary -= 1
                self._tick += 1
                b.last_used = self._tick
                self._evictable.push(b)
        self._used[PRIMARY_LEVEL] -= seq.private
        self._private -= seq.private
        seq.private = 0

    # ------------------------------------------------------------------ internals

    def _emit_stored(self, stored: list[CachedBlock], parent: CachedBlock | None) -> None:
        stats = self.stats
        stats.stored_events += 1
        stats.stored_blocks += len(stored)
        if self._events is None:
            return
        make = self._block_info
        infos = []
        prev = None if parent is None else parent.block_hash
        for b in stored:
            infos.append(make(b.block_hash, prev, b.tokens, b.lora_id, True, b.priority))
            prev = b.block_hash
        self._events.enqueue_stored_event(infos, self.window_size)

    def _emit_updated(
        self,
        block_hash: int,
        *,
        cache_level: KVCacheEventDiff | None = None,
        priority: KVCacheEventDiff | None = None,
    ) -> None:
        if self._events is not None:
            self._events.enqueue_updated_event(
                KVCacheUpdatedData(block_hash, cache_level=cache_level, priority=priority), self.window_size
            )

    def _adopt(self, b: CachedBlock) -> None:
        """A request computed a block that is already cached: use the cached one."""
        self.stats.adopted_blocks += 1
        if b.level != PRIMARY_LEVEL:
            # The fresh primary copy replaces the offloaded one: the private slot becomes its home.
            self._used[SECONDARY_LEVEL] -= 1
            b.level = PRIMARY_LEVEL
            if b.parent is not None:
                b.parent.primary_children += 1
            self._emit_updated(b.block_hash, cache_level=_ONBOARD)
            self.stats.onboards += 1
            self._referenced_primary += 1
        else:
            self._used[PRIMARY_LEVEL] -= 1  # the private copy is freed
            if b.ref_count == 0:
                self._referenced_primary += 1
        b.ref_count += 1

    def _onboard(self, b: CachedBlock) -> None:
        """Bring a referenced secondary block back to primary, swapping a victim out if full."""
        self._used[SECONDARY_LEVEL] -= 1  # its secondary slot is free for the victim
        self._make_primary_room()
        self._used[PRIMARY_LEVEL] += 1
        b.level = PRIMARY_LEVEL
        if b.parent is not None:
            b.parent.primary_children += 1
        self._referenced_primary += 1
        self._emit_updated(b.block_hash, cache_level=_ONBOARD)
        self.stats.onboards += 1

    # Eviction is the simulator's hot path: at the freshness bench's top step every new block
    # evicts one (offloaded: an Updated event; a secondary block removed for it: a Removed one).

    def _make_primary_room(self) -> None:
        used = self._used
        if used[PRIMARY_LEVEL] < self.num_primary_blocks:
            return
        pop = self._evictable.pop
        while used[PRIMARY_LEVEL] >= self.num_primary_blocks:
            victim = pop(PRIMARY_LEVEL)
            if victim is None:
                raise CacheFullError(f"no evictable primary block (window {self.window_size})")
            self._evict_primary(victim)

    def _make_secondary_room(self) -> bool:
        if self.num_secondary_blocks == 0:
            return False
        used = self._used
        while used[SECONDARY_LEVEL] >= self.num_secondary_blocks:
            victim = self._evictable.pop(SECONDARY_LEVEL)
            if victim is None:
                return False
            self._remove(victim)
        return True

    def _evict_primary(self, victim: CachedBlock) -> None:
        stats = self.stats
        stats.evictions += 1
        if victim.priority >= self.offload_min_priority and self._make_secondary_room():
            used = self._used
            used[PRIMARY_LEVEL] -= 1
            used[SECONDARY_LEVEL] += 1
            victim.level = SECONDARY_LEVEL
            parent = victim.parent
            events = self._events
            if events is not None:  # self._emit_updated(..., cache_level=_OFFLOAD), inline
                events.enqueue_updated_event(
                    KVCacheUpdatedData(victim.block_hash, _OFFLOAD, None), self.window_size
                )
            stats.offloads += 1
            push = self._evictable.push
            if parent is not None:
                parent.primary_children -= 1
                push(parent)
            push(victim)
        else:
            self._remove_subtree(victim)

    def _remove_subtree(self, root: CachedBlock) -> None:
        """Remove ``root`` and its descendants, children before parents."""
        stack: list[tuple[CachedBlock, bool]] = [(root, False)]
        while stack:
            b, expanded = stack.pop()
            if expanded or not b.children:
                self._remove(b)
            else:
                stack.append((b, True))
                stack.extend((c, False) for c in b.children)

    def _remove(self, b: CachedBlock) -> None:
        assert b.ref_count == 0 and not b.children, "only unreferenced leaves leave the cache"
        h = b.block_hash
        events = self._events
        if events is not None:
            events.enqueue_removed_event(h, self.window_size)
        self.stats.removed_blocks += 1
        level = b.level
        self._used[level] -= 1
        del self._blocks[h]
        b.alive = False
        parent = b.parent
        if parent is not None:
            del parent.children[b]
            if level == PRIMARY_LEVEL:
                parent.primary_children -= 1
            self._evictable.push(parent)

    # ------------------------------------------------------------------ checks

    def check_invariants(self) -> None:
        """Recount everything from scratch; raise ``AssertionError`` on any inconsistency."""
        used = [0, 0]
        referenced = 0
        for h, b in self._blocks.items():
            assert b.alive and b.block_hash == h
            used[b.level] += 1
            if b.ref_count > 0:
                assert b.level == PRIMARY_LEVEL, f"referenced block {h:#x} is not in primary memory"
                referenced += 1
            if b.parent is not None:
                assert b.parent.alive and self._blocks.get(b.parent.block_hash) is b.parent, (
                    f"block {h:#x} is held without its parent"
                )
                assert b in b.parent.children
                assert b.parent.level <= b.level, f"block {h:#x} is in a faster level than its parent"
            assert b.primary_children == sum(1 for c in b.children if c.level == PRIMARY_LEVEL)
        private = sum(s.private for s in self._seqs.values())
        assert private == self._private, (private, self._private)
        assert used[PRIMARY_LEVEL] + private == self._used[PRIMARY_LEVEL], (used, private, self._used)
        assert used[SECONDARY_LEVEL] == self._used[SECONDARY_LEVEL], (used, self._used)
        assert referenced == self._referenced_primary, (referenced, self._referenced_primary)
        assert self._used[PRIMARY_LEVEL] <= self.num_primary_blocks, "primary capacity exceeded"
        assert self._used[SECONDARY_LEVEL] <= self.num_secondary_blocks, "secondary capacity exceeded"
        refs: dict[int, int] = {}
        for s in self._seqs.values():
            for b in s.blocks:
                refs[id(b)] = refs.get(id(b), 0) + 1
        for b in self._blocks.values():
            assert b.ref_count == refs.get(id(b), 0), f"block {b.block_hash:#x} has a wrong reference count"
