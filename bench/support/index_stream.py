"""A realistic, seeded KV-cache event stream for the index benchmark, in two wire formats.

A fleet of engine instances with attention-DP ranks (each rank one worker with its own cache)
serves conversations:

- every conversation starts with one of a few shared *system prompts*; some then attach
  popular *documents* (64 blocks each, Zipf-distributed popularity, so the same documents sit
  in many caches), a few attach many (long contexts past 512 blocks);
- each turn adds a user message (1-4 blocks) to the history, and the reply is generated block
  by block; a conversation mostly stays on its worker (multi-turn growth), sometimes moves;
- a worker prefills what it does not hold in Stored events of at most 64 blocks (long
  prefills of 64 blocks, 1-4 blocks for a new turn), then stores each generated block alone;
- a bounded pool of live conversations (a few per worker): new ones push old ones out;
- caches are bounded: an LRU evicts leaf blocks only (ancestors are always more recent than
  their descendants). Half the instances offload to host memory: their oldest primary blocks
  move to the secondary level (Updated, level 0 -> 1), the oldest secondary blocks are
  Removed, and a secondary block that is reused moves back (Updated 1 -> 0); the other half
  remove their oldest primary blocks. Removals of one step merge into one Removed event.

Block hashes are chained and deterministic, as TensorRT-LLM's: ``xxh3_64(parent hash, token
ids)``, so equal prefixes have equal hashes on every worker.

The stream is produced once and written twice: as kvevents ``EventBatch`` objects (one batch
per instance every few requests, events of all its ranks) and as NVIDIA Dynamo ``RadixTree``
JSON events (``apply_event(worker_id, bytes)``, ``dp_rank`` = attention-DP rank; Created
becomes "cleared"; Updated has no Dynamo counterpart and is left out, since Dynamo's tree does
not track levels).
"""

from __future__ import annotations

import random
import struct
from array import array
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import xxhash
from kvevents.schemas import (
    EventBatch,
    KVCacheCreatedData,
    KVCacheEvent,
    KVCacheEventDiff,
    KVCacheRemovedData,
    KVCacheStoredBlockData,
    KVCacheStoredData,
    KVCacheUpdatedData,
)

try:
    import orjson

    def _json(obj: Any) -> bytes:
        return orjson.dumps(obj)
except ImportError:  # pragma: no cover - orjson is in the bench extra
    import json

    def _json(obj: Any) -> bytes:
        return json.dumps(obj, separators=(",", ":")).encode()


@dataclass
class StreamConfig:
    """Shape of the simulated fleet and workload."""

    seed: int = 20261202
    instances: int = 32
    dp_size: int = 8
    block_size: int = 32
    window_size: int = 32768
    primary_blocks: int = 2048
    secondary_blocks: int = 1024
    system_prompts: int = 16
    system_blocks: tuple[int, int] = (8, 32)
    documents: int = 400
    document_blocks: int = 64
    target_events: int = 600_000
    new_conversation: float = 0.25
    with_documents: float = 0.35
    long_context: float = 0.04
    long_context_documents: tuple[int, int] = (7, 10)
    user_blocks: tuple[int, int] = (1, 4)
    reply_blocks: tuple[int, int] = (1, 3)
    stay_on_worker: float = 0.9
    active_conversations_per_worker: int = 6
    offloading_instances: float = 0.25
    requests_per_batch: int = 8
    max_prefill_blocks: int = 64


@dataclass
class Stream:
    """The stream in both formats, plus what queries need."""

    config: StreamConfig
    batches: list[EventBatch] = field(default_factory=list)
    dynamo_events: list[tuple[int, bytes]] = field(default_factory=list)
    events_by_kind: dict[str, int] = field(default_factory=dict)
    blocks_stored: int = 0
    held_worker_blocks: int = 0
    conversations: list[tuple[int, list[int]]] = field(default_factory=list)
    """(worker index, path of block ids) for every conversation."""
    engine_hashes: list[int] = field(default_factory=list)
    local_hashes: list[int] = field(default_factory=list)
    """Dynamo's per-block tokens hash (xxh3_64 of the block's tokens, seed 1337), per block id."""
    tokens: list[array] = field(default_factory=list)
    worker_held: list[set[int]] = field(default_factory=list)

    @property
    def events(self) -> int:
        return sum(self.events_by_kind.values())


class _Worker:
    __slots__ = ("index", "instance", "next_id", "offloads", "primary", "rank", "secondary")

    def __init__(self, index: int, instance: int, rank: int, offloads: bool) -> None:
        self.index = index
        self.instance = instance
        self.rank = rank
        self.offloads = offloads
        self.next_id = 0
        self.primary: OrderedDict[int, None] = OrderedDict()
        self.secondary: OrderedDict[int, None] = OrderedDict()


class _Generator:
    def __init__(self, config: StreamConfig) -> None:
        self.c = config
        self.rng = random.Random(config.seed)
        self.out = Stream(config)
        self.children: dict[tuple[int, Any], int] = {}
        self.parent: list[int] = []
        offloading = set(
            self.rng.sample(range(config.instances), round(config.instances * config.offloading_instances))
        )
        self.workers = [
            _Worker(i * config.dp_size + r, i, r, i in offloading)
            for i in range(config.instances)
            for r in range(config.dp_size)
        ]
        self.pending: list[list[KVCacheEvent]] = [[] for _ in range(config.instances)]
        self.requests_since_flush = [0] * config.instances
        self.sequence = [0] * config.instances
        self.producer_ids = [self.rng.getrandbits(62) for _ in range(config.instances)]
        self.system = [
            self._chunks(self.rng.randint(*config.system_blocks)) for _ in range(config.system_prompts)
        ]
        self.docs = [self._chunks(config.document_blocks) for _ in range(config.documents)]
        weights = [1.0 / (k + 1) ** 1.1 for k in range(config.documents)]
        self.doc_weights = list(_accumulate(weights))
        sys_weights = [1.0 / (k + 1) for k in range(config.system_prompts)]
        self.sys_weights = list(_accumulate(sys_weights))
        self.conversations: list[list[Any]] = []  # [worker, path]

    # -------------------------------------------------------------- blocks

    def _chunks(self, n: int) -> list[array]:
        return [self._tokens() for _ in range(n)]

    def _tokens(self) -> array:
        raw = array("i", self.rng.randbytes(4 * self.c.block_size))
        return array("i", (t & 0x1FFFF for t in raw))

    def _block(self, parent: int, chunk: array) -> int:
        """The block id of ``chunk`` after block ``parent`` (-1: the root), made once."""
        key = (parent, id(chunk))
        found = self.children.get(key)
        if found is not None:
            return found
        out = self.out
        block_id = len(out.engine_hashes)
        parent_hash = out.engine_hashes[parent] if parent >= 0 else 0
        data = chunk.tobytes()
        out.engine_hashes.append(xxhash.xxh3_64_intdigest(struct.pack("<Q", parent_hash) + data))
        out.local_hashes.append(xxhash.xxh3_64_intdigest(data, seed=1337))
        out.tokens.append(chunk)
        self.parent.append(parent)
        self.children[key] = block_id
        return block_id

    def _extend(self, path: list[int], chunks: list[array]) -> None:
        for chunk in chunks:
            path.append(self._block(path[-1] if path else -1, chunk))

    # -------------------------------------------------------------- events

    def _emit(self, w: _Worker, data: Any) -> None:
        event = KVCacheEvent(w.next_id, data, self.c.window_size, w.rank)
        out = self.out
        kind = type(data).__name__
        out.events_by_kind[kind] = out.events_by_kind.get(kind, 0) + 1
        self.pending[w.instance].append(event)
        if isinstance(data, KVCacheStoredData):
            body: Any = {
                "stored": {
                    "parent_hash": data.parent_hash,
                    "blocks": [
                        {"block_hash": b.block_hash, "tokens_hash": out.local_hashes[self._ids[b.block_hash]]}
                        for b in data.blocks
                    ],
                }
            }
            out.blocks_stored += len(data.blocks)
        elif isinstance(data, KVCacheRemovedData):
            body = {"removed": {"block_hashes": data.block_hashes}}
        elif isinstance(data, KVCacheCreatedData):
            body = "cleared"
        else:
            body = None  # Updated: Dynamo's tree has no levels
        if body is not None:
            out.dynamo_events.append(
                (w.instance, _json({"event_id": w.next_id, "data": body, "dp_rank": w.rank}))
            )
        w.next_id += 1

    def _store(self, w: _Worker, path: list[int], start: int, end: int) -> None:
        hashes = self.out.engine_hashes
        parent = hashes[path[start - 1]] if start > 0 else None
        blocks = []
        for i in range(start, end):
            block_id = path[i]
            self._ids[hashes[block_id]] = block_id
            blocks.append(KVCacheStoredBlockData(hashes[block_id], self.out.tokens[block_id]))
        self._emit(w, KVCacheStoredData(parent, blocks))

    def _flush(self, instance: int) -> None:
        events = self.pending[instance]
        if not events:
            return
        self.out.batches.append(
            EventBatch(
                f"engine-{instance:03d}",
                events,
                attention_dp_size=self.c.dp_size,
                producer_id=self.producer_ids[instance],
                sequence=self.sequence[instance],
                created_at_us=1_700_000_000_000_000 + len(self.out.batches),
            )
        )
        self.sequence[instance] += 1
        self.pending[instance] = []
        self.requests_since_flush[instance] = 0

    # -------------------------------------------------------------- serving

    def _serve(self, w: _Worker, path: list[int], reply_chunks: int) -> None:
        primary, secondary = w.primary, w.secondary
        held = 0
        while held < len(path) and (path[held] in primary or path[held] in secondary):
            held += 1
        hashes = self.out.engine_hashes
        for i in range(held):  # onboard reused secondary blocks
            b = path[i]
            if b in secondary:
                del secondary[b]
                primary[b] = None
                self._emit(w, KVCacheUpdatedData(hashes[b], cache_level=KVCacheEventDiff(1, 0)))
        step = self.c.max_prefill_blocks
        for start in range(held, len(path), step):
            self._store(w, path, start, min(start + step, len(path)))
        for b in path[held:]:
            primary[b] = None
        for _ in range(reply_chunks):  # decode: one Stored event per generated block
            path.append(self._block(path[-1], self._tokens()))
            primary[path[-1]] = None
            self._store(w, path, len(path) - 1, len(path))
        for b in reversed(path):  # leaf to root: ancestors end up more recent
            if b in primary:
                primary.move_to_end(b)
        removed = []
        while len(primary) > self.c.primary_blocks:
            b, _ = primary.popitem(last=False)
            if w.offloads and self.c.secondary_blocks:
                secondary[b] = None
                self._emit(w, KVCacheUpdatedData(hashes[b], cache_level=KVCacheEventDiff(0, 1)))
            else:
                removed.append(hashes[b])
        while len(secondary) > self.c.secondary_blocks:
            b, _ = secondary.popitem(last=False)
            removed.append(hashes[b])
        if removed:
            self._emit(w, KVCacheRemovedData(removed))

    def run(self) -> Stream:
        c, rng = self.c, self.rng
        self._ids: dict[int, int] = {}
        for w in self.workers:
            self._emit(w, KVCacheCreatedData([c.primary_blocks, c.secondary_blocks if w.offloads else 0]))
        active_limit = c.active_conversations_per_worker * len(self.workers)
        active: list[list[Any]] = []
        for instance in range(c.instances):
            self._flush(instance)
        while self.out.events < c.target_events:
            if not active or rng.random() < c.new_conversation:
                path: list[int] = []
                self._extend(path, self.system[_pick(rng, self.sys_weights)])
                if rng.random() < c.long_context:
                    for _ in range(rng.randint(*c.long_context_documents)):
                        self._extend(path, self.docs[_pick(rng, self.doc_weights)])
                elif rng.random() < c.with_documents:
                    self._extend(path, self.docs[_pick(rng, self.doc_weights)])
                convo = [rng.choice(self.workers), path]
                self.conversations.append(convo)
                if len(active) < active_limit:
                    active.append(convo)
                else:  # the pool of live conversations is full: one goes idle for good
                    active[rng.randrange(active_limit)] = convo
            else:
                convo = rng.choice(active)
                if rng.random() > c.stay_on_worker:
                    convo[0] = rng.choice(self.workers)
            w, path = convo
            self._extend(path, self._chunks(rng.randint(*c.user_blocks)))
            self._serve(w, path, rng.randint(*c.reply_blocks))
            self.requests_since_flush[w.instance] += 1
            if self.requests_since_flush[w.instance] >= c.requests_per_batch:
                self._flush(w.instance)
        for instance in range(c.instances):
            self._flush(instance)
        out = self.out
        out.conversations = [(w.index, path) for w, path in self.conversations]
        out.worker_held = [set(w.primary) | set(w.secondary) for w in self.workers]
        out.held_worker_blocks = sum(len(h) for h in out.worker_held)
        del self._ids
        return out


def _accumulate(weights: list[float]) -> list[float]:
    total, out = 0.0, []
    for w in weights:
        total += w
        out.append(total)
    return out


def _pick(rng: random.Random, cumulative: list[float]) -> int:
    import bisect

    return bisect.bisect_left(cumulative, rng.random() * cumulative[-1])


def generate(config: StreamConfig) -> Stream:
    """Simulate the fleet until ``config.target_events`` events were produced."""
    return _Generator(config).run()


def worker_key(stream: Stream, worker: int) -> tuple[str, int]:
    """(instance_id, rank) of worker index ``worker``."""
    dp = stream.config.dp_size
    return f"engine-{worker // dp:03d}", worker % dp
