"""A large synthetic fleet's KV-cache events, written straight to Avro bytes (25M worker-blocks
in seconds), with the same stream as Dynamo ``RadixTree`` JSON events and query paths.

Each worker (an attention-DP rank of an instance) serves conversations: a shared prefix (one
of a few system prompts, then 0-6 popular 64-block documents, Zipf-picked, so the same prefix
blocks sit in many caches) and a private tail. A worker stores the part of a prefix it does
not hold and its tail in Stored events of at most 64 blocks, the last 1-3 tail blocks one by
one (decode); past ``blocks_per_worker`` it evicts its oldest conversation's tail (one
Removed event, leaf first). Shared prefixes stay held. The stream goes on until every
worker stored ``(1 + churn) * blocks_per_worker`` blocks.

Blocks are written as fixed-size Avro records (numpy, no Python object per block): engine
hashes in [2^62, 2^63) (a 10-byte varint), 32 tokens in [2^13, 2^16) (3 bytes each), default
attributes. ``tests/unit/bench/`` checks the bytes against ``encode_batch``.
"""

from __future__ import annotations

import bisect
import random
from collections import deque
from dataclasses import dataclass, field
from itertools import accumulate
from typing import Any

import numpy as np
from kvevents.schemas import EventBatch, encode_batch
from kvevents.schemas.codec import envelope_of

try:
    import orjson

    def _json(obj: Any) -> bytes:
        return orjson.dumps(obj)
except ImportError:  # pragma: no cover - orjson is in the bench extra
    import json

    def _json(obj: Any) -> bytes:
        return json.dumps(obj, separators=(",", ":")).encode()


BLOCK_TOKENS = 32
BLOCK_BYTES = 10 + 1 + 3 * BLOCK_TOKENS + 1 + 6
_BLOCK_TAIL = np.array([0, 0, 0x46, 0, 0, 0], dtype=np.uint8)  # lora null, level 0, priority 35, ...


@dataclass(frozen=True)
class FleetConfig:
    """Shape of the synthetic fleet."""

    workers: int = 256
    dp_size: int = 8
    blocks_per_worker: int = 4096
    churn: float = 0.25
    seed: int = 17
    window_size: int = 32768
    system_prompts: int = 16
    system_blocks: tuple[int, int] = (8, 32)
    documents: int = 200
    document_blocks: int = 64
    shared_prefixes: int = 256
    docs_per_prefix: tuple[int, int] = (0, 6)
    private_blocks: tuple[int, int] = (16, 384)
    decode_blocks: tuple[int, int] = (1, 3)
    max_event_blocks: int = 64
    events_per_batch: int = 64

    @property
    def instances(self) -> int:
        return max(1, self.workers // self.dp_size)

    @property
    def ranks(self) -> int:
        return min(self.dp_size, self.workers)


@dataclass
class InstanceStream:
    """One instance's batches (Avro single-object bytes), its Dynamo events, figures, and the
    (engine hashes, Dynamo tokens hashes) paths of a sample of conversations held at the end."""

    batches: list[bytes]
    dynamo_batches: list[list[tuple[int, bytes]]]
    """Per batch, the same events for Dynamo: ``(worker id, JSON)``."""
    events: int = 0
    blocks_stored: int = 0
    held_worker_blocks: int = 0
    paths: list[tuple[list[int], list[int]]] = field(default_factory=list)


def _varint(z: int) -> bytes:
    out = bytearray()
    while z >= 0x80:
        out.append((z & 0x7F) | 0x80)
        z >>= 7
    out.append(z)
    return bytes(out)


def _long(n: int) -> bytes:
    """Avro long (zigzag varint) of a signed or unsigned-64 value (two's complement)."""
    if n >= 1 << 63:
        n -= 1 << 64
    return _varint((n << 1) ^ (n >> 63) if n < 0 else n << 1)


_CHUNK = 1 << 15


def block_records(hashes: np.ndarray, tokens: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """``(n, BLOCK_BYTES)`` uint8 (into ``out`` when given): the Avro ``KVCacheStoredBlockData``
    of each block (hashes in [2^62, 2^63), tokens in [2^13, 2^16), default attributes); columns
    0-9 are the hash's Avro long. Done in chunks: fresh memory is slow to touch on small VMs."""
    n = len(hashes)
    if out is None:
        out = np.empty((n, BLOCK_BYTES), dtype=np.uint8)
    for start in range(0, n, _CHUNK):
        end = min(n, start + _CHUNK)
        _records_into(hashes[start:end], tokens[start:end], out[start:end])
    return out[:n]


def _records_into(hashes: np.ndarray, tokens: np.ndarray, out: np.ndarray) -> None:
    n = len(hashes)
    u64 = np.uint64
    z = hashes.astype(u64) << u64(1)
    lo = np.zeros(n, dtype=u64)
    for k in range(8):  # varint bytes 0-7, packed little-endian
        lo |= (((z >> u64(7 * k)) & u64(0x7F)) | u64(0x80)) << u64(8 * k)
    out[:, :8] = lo.astype("<u8").view(np.uint8).reshape(n, 8)
    out[:, 8] = ((z >> u64(56)) & u64(0x7F)) | u64(0x80)
    out[:, 9] = z >> u64(63)
    out[:, 10] = BLOCK_TOKENS << 1
    zt = tokens.astype(np.uint32) << np.uint32(1)
    packed = ((zt & 0x7F) | 0x80) | ((((zt >> 7) & 0x7F) | 0x80) << 8) | ((zt >> 14) << 16)
    end = 11 + 3 * BLOCK_TOKENS
    out[:, 11:end] = packed.astype("<u4").view(np.uint8).reshape(n, BLOCK_TOKENS, 4)[:, :, :3].reshape(n, -1)
    out[:, end] = 0
    out[:, end + 1 :] = _BLOCK_TAIL


def _hashes(rng: np.random.Generator, n: int) -> np.ndarray:
    return rng.integers(1 << 62, 1 << 63, size=n, dtype=np.uint64)


def _tokens(rng: np.random.Generator, n: int) -> np.ndarray:
    return rng.integers(1 << 13, 1 << 16, size=(n, BLOCK_TOKENS), dtype=np.uint32)


def _pick(rng: random.Random, cumulative: list[float]) -> int:
    return bisect.bisect_left(cumulative, rng.random() * cumulative[-1])


def _zipf(n: int, s: float) -> list[float]:
    return list(accumulate(1.0 / (k + 1) ** s for k in range(n)))


class Fleet:
    """The shared prefixes, built once; :meth:`instance` writes one instance's stream."""

    def __init__(self, config: FleetConfig) -> None:
        c = self.c = config
        rng = random.Random(c.seed)
        nrng = np.random.default_rng([c.seed, 0])
        sys_chunks = [list(range(rng.randint(*c.system_blocks))) for _ in range(c.system_prompts)]
        # token rows: system prompt s block j and document d block j share one pool
        sys_rows, row = [], 0
        for chunks in sys_chunks:
            sys_rows.append(list(range(row, row + len(chunks))))
            row += len(chunks)
        doc_rows = [
            list(range(row + d * c.document_blocks, row + (d + 1) * c.document_blocks))
            for d in range(c.documents)
        ]
        pool_tokens = _tokens(nrng, row + c.documents * c.document_blocks)
        pool_local = nrng.integers(0, 1 << 63, size=len(pool_tokens), dtype=np.uint64)
        sys_w, doc_w = _zipf(c.system_prompts, 1.0), _zipf(c.documents, 1.1)
        children: dict[tuple[int, int], int] = {}
        node_rows: list[int] = []
        self.prefixes: list[list[int]] = []
        seen: set[tuple[int, ...]] = set()
        while len(self.prefixes) < c.shared_prefixes:
            rows = list(sys_rows[_pick(rng, sys_w)])
            docs = [_pick(rng, doc_w) for _ in range(rng.randint(*c.docs_per_prefix))]
            for d in docs:
                rows += doc_rows[d]
            if tuple(rows) in seen:
                rows += doc_rows[rng.randrange(c.documents)]
            seen.add(tuple(rows))
            path, parent = [], -1
            for r in rows:
                node = children.get((parent, r))
                if node is None:
                    node = children[(parent, r)] = len(node_rows)
                    node_rows.append(r)
                path.append(node)
                parent = node
            self.prefixes.append(path)
        rows_arr = np.array(node_rows, dtype=np.int64)
        self.shared_engine = _hashes(nrng, len(node_rows))
        self.shared_local = pool_local[rows_arr]
        self.shared_records = block_records(self.shared_engine, pool_tokens[rows_arr])
        self.shared_engine_list: list[int] = self.shared_engine.tolist()
        self.shared_local_list: list[int] = self.shared_local.tolist()
        self.prefix_weights = _zipf(c.shared_prefixes, 1.0)
        self._chunk_cache: dict[tuple[int, int, int], bytes] = {}
        self._buffer = np.empty((0, BLOCK_BYTES), dtype=np.uint8)

    @property
    def distinct_shared_blocks(self) -> int:
        return len(self.shared_engine)

    def _shared_bytes(self, prefix: int, start: int, end: int) -> bytes:
        key = (prefix, start, end)
        found = self._chunk_cache.get(key)
        if found is None:
            nodes = self.prefixes[prefix][start:end]
            found = self._chunk_cache[key] = self.shared_records[nodes].tobytes()
        return found

    def instance(self, index: int, *, dynamo: bool = False, sample_paths: int = 64) -> InstanceStream:
        """Instance ``index``'s stream: its batches in order (all its ranks interleaved)."""
        c = self.c
        rng = random.Random(c.seed * 1_000_003 + index)
        nrng = np.random.default_rng([c.seed, index + 1])
        budget, goal = c.blocks_per_worker, int(c.blocks_per_worker * (1 + c.churn))
        # per rank: events as tuples, built into bytes once the private rows exist
        plans: list[list[tuple[Any, ...]]] = []
        lives: list[deque[tuple[int, int, int]]] = []
        shared_held: list[set[int]] = []
        rows = 0
        for _ in range(c.ranks):
            plan: list[tuple[Any, ...]] = []
            live: deque[tuple[int, int, int]] = deque()  # (prefix, first private row, end row)
            held_shared: set[int] = set()
            held = stored = 0
            while stored < goal:
                p = _pick(rng, self.prefix_weights)
                path = self.prefixes[p]
                k = 0
                while k < len(path) and path[k] in held_shared:
                    k += 1
                for start in range(k, len(path), c.max_event_blocks):
                    end = min(start + c.max_event_blocks, len(path))
                    plan.append(("S", p, start, end))
                held_shared.update(path[k:])
                n = rng.randint(*c.private_blocks)
                first = rows
                rows += n
                tail = min(n, rng.randint(*c.decode_blocks))
                for start in range(first, first + n - tail, c.max_event_blocks):
                    plan.append(("P", p, first, start, min(start + c.max_event_blocks, first + n - tail)))
                for r in range(first + n - tail, first + n):
                    plan.append(("P", p, first, r, r + 1))
                live.append((p, first, first + n))
                stored += len(path) - k + n
                held += len(path) - k + n
                while held > budget and len(live) > 1:
                    _, a, b = live.popleft()
                    plan.append(("R", a, b))
                    held -= b - a
            plans.append(plan)
            lives.append(live)
            shared_held.append(held_shared)
        engine = _hashes(nrng, rows)
        local = nrng.integers(0, 1 << 63, size=rows, dtype=np.uint64) if dynamo else None
        if len(self._buffer) < rows:  # reused instance after instance
            self._buffer = np.empty((rows, BLOCK_BYTES), dtype=np.uint8)
        records = self._buffer[:rows]
        for start in range(0, rows, _CHUNK):
            end = min(rows, start + _CHUNK)
            _records_into(engine[start:end], _tokens(nrng, end - start), records[start:end])
        engine_list: list[int] = engine.tolist()
        local_list: list[int] = local.tolist() if local is not None else []
        out = InstanceStream([], [])
        instance_id = fleet_instance_id(index)
        rank_bytes = [b"\x02" + _long(r) for r in range(c.ranks)]
        window = _long(c.window_size)
        per_rank: list[list[bytes]] = []
        dyn_rank: list[list[tuple[int, bytes]]] = []
        for rank, plan in enumerate(plans):
            events: list[bytes] = []
            dyn: list[tuple[int, bytes]] = []
            for event_id, ev in enumerate(plan):
                head = _long(event_id)
                if ev[0] == "R":
                    count = ev[2] - ev[1]
                    body = b"\x04" + _long(count) + records[ev[1] : ev[2], :10][::-1].tobytes() + b"\x00"
                    if dynamo:
                        data: Any = {"removed": {"block_hashes": engine_list[ev[1] : ev[2]][::-1]}}
                else:
                    if ev[0] == "S":
                        _, p, start, end = ev
                        nodes = self.prefixes[p]
                        parent = self.shared_engine_list[nodes[start - 1]] if start else None
                        parent_bytes = self.shared_records[nodes[start - 1], :10].tobytes() if start else b""
                        blocks = self._shared_bytes(p, start, end)
                        count = end - start
                    else:
                        _, p, first, start, end = ev
                        prev = self.prefixes[p][-1]
                        if start > first:
                            parent, parent_bytes = engine_list[start - 1], records[start - 1, :10].tobytes()
                        else:
                            parent = self.shared_engine_list[prev]
                            parent_bytes = self.shared_records[prev, :10].tobytes()
                        blocks = records[start:end].tobytes()
                        count = end - start
                    out.blocks_stored += count
                    union = b"\x00" if parent is None else b"\x02" + parent_bytes
                    body = b"\x02" + union + _long(count) + blocks + b"\x00"
                    if dynamo:
                        if ev[0] == "S":
                            sel = self.prefixes[ev[1]][start:end]
                            pairs = [(self.shared_engine_list[i], self.shared_local_list[i]) for i in sel]
                        else:
                            pairs = list(zip(engine_list[start:end], local_list[start:end], strict=True))
                        data = {
                            "stored": {
                                "parent_hash": parent,
                                "blocks": [{"block_hash": h, "tokens_hash": t} for h, t in pairs],
                            }
                        }
                events.append(head + body + window + rank_bytes[rank])
                if dynamo:
                    dyn.append((index, _json({"event_id": event_id, "data": data, "dp_rank": rank})))
            out.events += len(events)
            per_rank.append(events)
            dyn_rank.append(dyn)
        merged = [e for group in _round_robin(per_rank) for e in group]
        merged_dyn = [e for group in _round_robin(dyn_rank) for e in group]
        step = c.events_per_batch
        for seq, start in enumerate(range(0, len(merged), step)):
            chunk = merged[start : start + step]
            envelope = envelope_of(
                encode_batch(
                    EventBatch(
                        instance_id, [], attention_dp_size=c.dp_size, producer_id=index + 1, sequence=seq
                    )
                )
            )
            out.batches.append(envelope + _long(len(chunk)) + b"".join(chunk) + b"\x00")
            if dynamo:  # Dynamo gets the same events in the same order, batch by batch
                out.dynamo_batches.append(merged_dyn[start : start + step])
        for live, held_shared in zip(lives, shared_held, strict=True):  # shared prefixes stay held
            out.held_worker_blocks += sum(b - a for _, a, b in live) + len(held_shared)
        picks = [(rank, conv) for rank, live in enumerate(lives) for conv in live]
        for _, (p, a, b) in rng.sample(picks, min(sample_paths, len(picks))):
            nodes = self.prefixes[p]
            e_path = [self.shared_engine_list[i] for i in nodes] + engine_list[a:b]
            l_path = [self.shared_local_list[i] for i in nodes] + (local_list[a:b] if dynamo else [])
            out.paths.append((e_path, l_path))
        return out


def _round_robin(groups: list[list[Any]]) -> list[list[Any]]:
    """Items of every group, one per group in turn (each group's order kept), as rows."""
    longest = max((len(g) for g in groups), default=0)
    return [[g[i] for g in groups if i < len(g)] for i in range(longest)]


def fleet_instance_id(index: int) -> str:
    return f"fleet-{index:04d}"


@dataclass
class FleetStream:
    """The whole fleet's stream: instances' batches interleaved as a multi-partition topic
    would deliver them."""

    config: FleetConfig
    batches: list[bytes]
    dynamo_batches: list[list[tuple[int, bytes]]]
    events: int
    blocks_stored: int
    held_worker_blocks: int
    paths: list[tuple[list[int], list[int]]]
    distinct_shared_blocks: int

    def dynamo_events(self, start: int = 0, end: int | None = None) -> list[tuple[int, bytes]]:
        """Dynamo's events of batches ``start:end``."""
        return [e for batch in self.dynamo_batches[start:end] for e in batch]


def generate_fleet(config: FleetConfig, *, dynamo: bool = True, sample_paths: int = 1024) -> FleetStream:
    """Every instance's stream, batches interleaved instance by instance."""
    fleet = Fleet(config)
    per = max(8, -(-sample_paths // config.instances))
    parts = [fleet.instance(i, dynamo=dynamo, sample_paths=per) for i in range(config.instances)]
    batches = [b for row in _round_robin([p.batches for p in parts]) for b in row]
    dyn = [d for row in _round_robin([p.dynamo_batches for p in parts]) for d in row]
    return FleetStream(
        config,
        batches,
        dyn,
        sum(p.events for p in parts),
        sum(p.blocks_stored for p in parts),
        sum(p.held_worker_blocks for p in parts),
        [path for p in parts for path in p.paths],
        fleet.distinct_shared_blocks,
    )


def make_fleet_queries(
    paths: list[tuple[list[int], list[int]]], size: int, count: int, seed: int
) -> list[tuple[list[int], list[int]]]:
    """(engine hashes, Dynamo tokens hashes) of ``count`` queries of ``size`` blocks: half a held
    path's prefix (as long as held), half a held prefix cut short, then blocks nobody holds."""
    rng = random.Random(seed)
    long_paths = [p for p in paths if len(p[0]) >= size] or paths
    out = []
    for i in range(count):
        e_path, l_path = rng.choice(long_paths if i % 2 == 0 else paths)
        keep = min(len(e_path), size) if i % 2 == 0 else rng.randint(1, min(len(e_path), size))
        engine = e_path[:keep] + [rng.getrandbits(64) for _ in range(size - keep)]
        local = l_path[:keep] + [rng.getrandbits(64) for _ in range(size - keep)] if l_path else []
        out.append((engine, local))
    return out
