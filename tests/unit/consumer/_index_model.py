"""A naive reference model of CacheIndex (dicts and sets, written from the documented rules),
and a random producer that makes streams with every kind of trouble."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvevents.consumer.hashing import ROOT_CONTENT_HASH, content_hash_of_block
from kvevents.schemas import (
    EventBatch,
    KVCacheCreatedData,
    KVCacheEvent,
    KVCacheEventDiff,
    KVCacheRemovedData,
    KVCacheStoredBlockData,
    KVCacheStoredData,
    KVCacheUpdatedData,
    RankDrops,
)

LEVEL_MAX = 15
MAX_RETIRED = 1024  # retired producer ids an instance remembers
_ = ROOT_CONTENT_HASH


def clamp(value: int, top: int) -> int:
    return max(0, min(value, top))


@dataclass
class Worker:
    cursor: int | None = None
    fresh: bool = True
    last_created: bool = False
    split_blocks: int = 0
    split_tail: int | None = None
    gaps: int = 0
    windows: dict[int, dict[str, Any]] = field(default_factory=dict)  # window -> {"capacity", "blocks"}


@dataclass
class Instance:
    pid: int | None = None
    seq: int = 0
    retired: dict[int, int] = field(default_factory=dict)  # producer id -> last sequence seen
    dp: int = 1  # attention_dp_size of the last batch applied (not a replay)
    pending: list[int] = field(default_factory=list)  # every rank < n not seen yet: degraded on arrival


class NaiveIndex:
    """The documented rules, with plain dicts; blocks: {engine: [level, priority]} per window."""

    def __init__(self) -> None:
        self.instances: dict[str, Instance] = {}
        self.workers: dict[tuple[str, int], Worker] = {}
        self.content: dict[int, int | None] = {}  # engine hash -> content hash, while anyone holds it
        self.session_conflicts = 0

    def worker(self, iid: str, rank: int) -> Worker:
        w = self.workers.get((iid, rank))
        if w is None:
            w = self.workers[(iid, rank)] = Worker()
            for below in self.instances[iid].pending:
                if rank < below:
                    self.degrade(w)
        return w

    def degrade_all(self, iid: str, dp: int) -> None:
        """The instance's workers now; a rank below ``dp`` not seen yet when it first comes."""
        for (i, _r), w in self.workers.items():
            if i == iid:
                self.degrade(w)
        self.instances[iid].pending.append(max(1, dp))

    def held(self, engine: int) -> bool:
        return any(engine in win["blocks"] for w in self.workers.values() for win in w.windows.values())

    def forget_if_unheld(self, engine: int) -> None:
        if not self.held(engine):
            self.content.pop(engine, None)

    def degrade(self, w: Worker) -> None:
        w.gaps += 1
        w.last_created = False  # a Created event after a gap starts a new cache generation

    def apply(self, batch: EventBatch) -> None:
        inst = self.instances.setdefault(batch.instance_id, Instance())
        replay = False

        if inst.pid is None:
            inst.pid, inst.seq = batch.producer_id, batch.sequence
        elif batch.producer_id != inst.pid:
            if batch.producer_id in inst.retired:
                if batch.sequence > inst.retired[batch.producer_id]:  # two live producers: a conflict
                    inst.retired[batch.producer_id] = batch.sequence
                    self.session_conflicts += 1
                    self.degrade_all(batch.instance_id, inst.dp)
                return
            inst.retired[inst.pid] = inst.seq
            if len(inst.retired) > MAX_RETIRED:  # the producer retired longest ago is forgotten
                del inst.retired[next(iter(inst.retired))]
            inst.pid, inst.seq = batch.producer_id, batch.sequence
            for (i, _r), w in self.workers.items():
                if i == batch.instance_id:
                    w.fresh = True
                    w.last_created = False
            if batch.sequence != 0:
                self.degrade_all(batch.instance_id, batch.attention_dp_size)
        elif batch.sequence <= inst.seq:
            replay = True
        else:
            if batch.sequence > inst.seq + 1:
                self.degrade_all(batch.instance_id, batch.attention_dp_size)
            inst.seq = batch.sequence
        if not replay:
            inst.dp = batch.attention_dp_size
            for d in batch.dropped:
                if d.dropped_events > 0:
                    self.degrade(self.worker(batch.instance_id, d.attention_dp_rank))
        for k, event in enumerate(batch.events):
            w = self.worker(batch.instance_id, event.attention_dp_rank or 0)
            self.apply_event(w, event, batch.first_event_block_offset if k == 0 else 0)

    def apply_event(self, w: Worker, event: KVCacheEvent, offset: int) -> None:
        data = event.data
        is_stored = isinstance(data, KVCacheStoredData)
        is_created = isinstance(data, KVCacheCreatedData)
        offset = offset if is_stored else 0
        blocks: Sequence[KVCacheStoredBlockData] = data.blocks if is_stored else []
        parent = data.parent_hash if is_stored else None
        eid = event.event_id
        if w.fresh:
            w.fresh = False
            expected = 0 if w.cursor is None else w.cursor + 1
            if not is_created and (offset != 0 or eid != expected):
                self.degrade(w)
        elif eid < w.cursor:  # type: ignore[operator]
            return
        elif eid == w.cursor:
            if not (offset > 0 and w.split_blocks > 0):
                return
            if offset > w.split_blocks:
                self.degrade(w)
            else:
                skip = w.split_blocks - offset
                if skip >= len(blocks):
                    return
                blocks = blocks[skip:]
                parent = w.split_tail
        elif eid == w.cursor + 1:  # type: ignore[operator]
            if offset > 0:
                self.degrade(w)
        else:
            self.degrade(w)
        window = event.window_size
        if is_stored:
            self.store(w, window, parent, blocks)
            if data.blocks:
                w.split_blocks, w.split_tail = offset + len(data.blocks), data.blocks[-1].block_hash
            else:
                w.split_blocks, w.split_tail = 0, None
        else:
            w.split_blocks, w.split_tail = 0, None
            if is_created:
                if not w.last_created:
                    old = [e for win in w.windows.values() for e in win["blocks"]]
                    w.windows.clear()
                    for e in old:
                        self.forget_if_unheld(e)
                    w.gaps = 0
                old = list(w.windows.get(window, {"blocks": {}})["blocks"])
                w.windows[window] = {"capacity": tuple(data.num_blocks_per_cache_level), "blocks": {}}
                for e in old:
                    self.forget_if_unheld(e)
            elif isinstance(data, KVCacheRemovedData):
                win = w.windows.get(window)
                for e in data.block_hashes:
                    if win is not None and e in win["blocks"]:
                        del win["blocks"][e]
                        self.forget_if_unheld(e)
            elif isinstance(data, KVCacheUpdatedData):
                win = w.windows.get(window)
                if win is not None and data.block_hash in win["blocks"]:
                    entry = win["blocks"][data.block_hash]
                    if data.cache_level is not None:
                        entry[0] = clamp(data.cache_level.new_value, LEVEL_MAX)
                    if data.priority is not None:
                        entry[1] = clamp(data.priority.new_value, 255)
        w.cursor = eid
        w.last_created = is_created

    def store(
        self, w: Worker, window: int, parent: int | None, blocks: Sequence[KVCacheStoredBlockData]
    ) -> None:
        win = w.windows.setdefault(window, {"capacity": None, "blocks": {}})
        known = True
        parent_content: int | None = None  # None with known=True: the root of a prefix
        if parent is not None:
            parent_content = self.content.get(parent)
            known = parent_content is not None
        for b in blocks:
            # a block without tokens (a placeholder) has no content of its own
            c = content_hash_of_block(parent_content, b) if known and len(b.tokens) else None
            if self.content.get(b.block_hash) is None:
                self.content[b.block_hash] = c
            win["blocks"][b.block_hash] = [clamp(b.cache_level, LEVEL_MAX), clamp(b.priority, 255)]
            if c is None:
                c = self.content[b.block_hash]
            known, parent_content = c is not None, c

    # ---------------------------------------------------------------- queries

    def match(
        self, hashes: Sequence[int], by_content: bool, window: int | None, max_level: int
    ) -> dict[Any, tuple[int, int]]:
        """{(iid, rank): best (run, primary)} over the worker's windows."""
        out: dict[Any, tuple[int, int]] = {}
        for key, w in self.workers.items():
            for size, win in w.windows.items():
                if window is not None and size != window:
                    continue
                run = primary = 0
                for h in hashes:
                    if by_content:
                        levels = [lvl for e, (lvl, _) in win["blocks"].items() if self.content.get(e) == h]
                    else:
                        levels = [win["blocks"][h][0]] if h in win["blocks"] else []
                    levels = [lvl for lvl in levels if lvl <= max_level]
                    if not levels:
                        break
                    run += 1
                    primary += min(levels) == 0
                if run and (run, primary) > out.get(key, (0, 0)):
                    out[key] = (run, primary)
        return out

    def blocks(self, key: tuple[str, int], window: int) -> list[tuple[int, int | None, int, int]]:
        win = self.workers[key].windows.get(window) if key in self.workers else None
        if win is None:
            return []
        return sorted((e, self.content.get(e), lvl, prio) for e, (lvl, prio) in win["blocks"].items())


# ---------------------------------------------------------------- a producer with trouble


class TroubledProducer:
    """Instances with attention-DP ranks and window sizes, emitting batches, drops, splits,
    replays, lost batches and restarts. Engine hashes are shared across instances (TensorRT-LLM
    style) or seeded per instance (vLLM style). Tokens come from a tiny vocabulary so prefixes
    are shared and content hashes collide on purpose."""

    WINDOWS = (64, 128)
    BLOCK = 2

    def __init__(self, draw: Any, st: Any) -> None:
        self.draw = draw
        self.st = st
        self.delivered: list[EventBatch] = []
        self.instances: dict[str, dict[str, Any]] = {}
        for name in ("a", "b"):
            dp = draw(st.integers(1, 2))
            self.instances[name] = {
                "dp": dp,
                "seed": draw(st.sampled_from([0, hash(name) & 0xFFFF])),
                "pid": draw(st.integers(0, 3)),
                "seq": 0,
                "old": [],  # batches of retired producers
                "next_id": [0] * dp,
                "held": [{w: {} for w in self.WINDOWS} for _ in range(dp)],  # engine -> tokens
                "pending": [],
                "dropped": {},
            }

    def engine_hash(self, seed: int, parent: int | None, tokens: Sequence[int]) -> int:
        return hash((seed, parent, tuple(tokens))) & 0xFFFFFFFFFFFFFFFF

    def event(self, inst: dict[str, Any], rank: int, data: Any, window: int) -> None:
        eid = inst["next_id"][rank]
        inst["next_id"][rank] += 1
        inst["pending"].append(KVCacheEvent(eid, data, window, rank if inst["dp"] > 1 else None))

    def step(self) -> None:
        st, draw = self.st, self.draw
        name = draw(st.sampled_from(sorted(self.instances)))
        inst = self.instances[name]
        rank = draw(st.integers(0, inst["dp"] - 1))
        window = draw(st.sampled_from(self.WINDOWS))
        held = inst["held"][rank][window]
        op = draw(
            st.sampled_from(
                [
                    "store",
                    "store",
                    "store",
                    "remove",
                    "update",
                    "created",
                    "flush",
                    "flush",
                    "drop",
                    "lose",
                    "replay",
                    "restart",
                    "stale",
                    "conflict",
                    "snapshot",
                ]
            )
        )
        if op == "store":
            choices = [None, *sorted(held)]
            parent = draw(st.sampled_from(choices)) if draw(st.integers(0, 9)) else draw(st.integers(1, 5))
            blocks = []
            for _ in range(draw(st.integers(1, 3))):
                tokens = draw(st.lists(st.integers(0, 2), min_size=self.BLOCK, max_size=self.BLOCK))
                if draw(st.integers(0, 9)) == 0:  # a placeholder: no tokens (vLLM's offloading)
                    tokens = []
                engine = self.engine_hash(
                    inst["seed"], parent if not blocks else blocks[-1].block_hash, tokens
                )
                level = draw(st.sampled_from([0, 0, 1]))
                blocks.append(
                    KVCacheStoredBlockData(
                        engine, tokens, cache_level=level, priority=draw(st.integers(0, 100))
                    )
                )
                held[engine] = tokens
            self.event(inst, rank, KVCacheStoredData(parent, blocks), window)
        elif op == "remove" and held:
            victims = draw(st.lists(st.sampled_from(sorted(held)), min_size=1, max_size=2, unique=True))
            for v in victims:
                del held[v]
            self.event(inst, rank, KVCacheRemovedData(victims), window)
        elif op == "update" and held:
            target = draw(st.sampled_from(sorted(held)))
            level = draw(st.none() | st.integers(0, 1))
            prio = draw(st.none() | st.integers(0, 100))
            self.event(
                inst,
                rank,
                KVCacheUpdatedData(
                    target,
                    None if level is None else KVCacheEventDiff(1 - level, level),
                    None if prio is None else KVCacheEventDiff(35, prio),
                ),
                window,
            )
        elif op == "created":
            for w in draw(st.lists(st.sampled_from(self.WINDOWS), min_size=1, max_size=2, unique=True)):
                self.event(inst, rank, KVCacheCreatedData([10, 2]), w)
            for w in self.WINDOWS:
                inst["held"][rank][w].clear()
        elif op == "snapshot":  # a resync: every window re-created, then every held block re-stored
            for w in self.WINDOWS:
                self.event(inst, rank, KVCacheCreatedData([10, 2], snapshot=True), w)
            for w in self.WINDOWS:
                for engine, tokens in sorted(inst["held"][rank][w].items()):
                    self.event(
                        inst, rank, KVCacheStoredData(None, [KVCacheStoredBlockData(engine, tokens)]), w
                    )
        elif op == "flush":
            self.flush(inst, name)
        elif op == "drop" and inst["pending"]:
            lost = [e for e in inst["pending"] if (e.attention_dp_rank or 0) == rank]
            inst["pending"] = [e for e in inst["pending"] if (e.attention_dp_rank or 0) != rank]
            if lost and draw(st.booleans()):  # reported in-band, or a silent gap in event ids
                inst["dropped"][rank] = inst["dropped"].get(rank, 0) + len(lost)
        elif op == "lose":
            self.flush(inst, name, deliver=False)
        elif op == "replay" and self.delivered:
            self.delivered.append(draw(st.sampled_from(self.delivered)))
        elif op == "restart":
            self.flush(inst, name)
            inst["old"].extend(
                b for b in self.delivered if b.instance_id == name and b.producer_id == inst["pid"]
            )
            inst["pid"] += 10
            inst["seq"] = 0
            if draw(st.booleans()):  # the engine restarted too: ids from 0, a Created run per rank
                for r in range(inst["dp"]):
                    inst["next_id"][r] = 0
                    for w in self.WINDOWS:
                        inst["held"][r][w].clear()
                        self.event(inst, r, KVCacheCreatedData([10, 2]), w)
        elif op == "stale" and inst["old"]:
            self.delivered.append(draw(st.sampled_from(inst["old"])))
        elif op == "conflict" and inst["old"]:  # a retired producer still alive sends a new batch
            old = max(inst["old"], key=lambda b: (b.producer_id, b.sequence))
            zombie = EventBatch(
                name,
                [KVCacheEvent(10**6, KVCacheRemovedData([1]), self.WINDOWS[0], None)],
                attention_dp_size=inst["dp"],
                producer_id=old.producer_id,
                sequence=old.sequence + 1,
            )
            inst["old"].append(zombie)
            self.delivered.append(zombie)

    def flush(self, inst: dict[str, Any], name: str, deliver: bool = True) -> None:
        events = inst["pending"]
        if not events and not inst["dropped"]:
            return
        inst["pending"] = []
        dropped = [RankDrops(r, n) for r, n in sorted(inst["dropped"].items())]
        inst["dropped"] = {}
        batches = [(events, 0)]
        last = events[-1] if events else None
        if (
            last is not None
            and isinstance(last.data, KVCacheStoredData)
            and len(last.data.blocks) > 1
            and self.draw(self.st.booleans())
        ):
            k = self.draw(self.st.integers(1, len(last.data.blocks) - 1))
            blocks = last.data.blocks
            head = KVCacheEvent(
                last.event_id,
                KVCacheStoredData(last.data.parent_hash, blocks[:k]),
                last.window_size,
                last.attention_dp_rank,
            )
            parent = self.draw(self.st.sampled_from([blocks[k - 1].block_hash, None]))
            tail = KVCacheEvent(
                last.event_id, KVCacheStoredData(parent, blocks[k:]), last.window_size, last.attention_dp_rank
            )
            batches = [([*events[:-1], head], 0), ([tail], k)]
        for i, (evs, offset) in enumerate(batches):
            batch = EventBatch(
                name,
                evs,
                attention_dp_size=inst["dp"],
                producer_id=inst["pid"],
                sequence=inst["seq"],
                dropped=dropped if i == 0 else [],
                first_event_block_offset=offset,
            )
            inst["seq"] += 1
            if deliver:
                self.delivered.append(batch)
