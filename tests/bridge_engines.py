"""Engine-side fixtures of the bridge tests: the engines' own msgspec structs (as declared in
vLLM's ``vllm/distributed/kv_events.py`` and SGLang's ``kv_events.py``, in each historical
encoding) and a fake engine publisher on real pyzmq sockets (PUB per rank, ROUTER replay)."""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import Any

import msgspec

END_SEQ = (-1).to_bytes(8, "big", signed=True)
_NONE: Any = None


def engine_structs(kind: str) -> dict[str, Any]:
    """Struct classes encoding as one engine release does.

    - ``vllm``: current vLLM (events as maps with a ``"type"`` tag, the batch still the array
      ``[ts, events, data_parallel_rank]``), hashes int or bytes;
    - ``vllm-map-batch``: the same events in a map batch ``{ts, events, data_parallel_rank}`` (a
      vLLM revision sent it; the readers take it too);
    - ``vllm-positional``: vLLM before #42892 (arrays, tag first, batch ``[ts, events, rank]``);
    - ``sglang-old``: SGLang 0.4 (arrays, 5-field BlockStored, 1-field BlockRemoved, ``[ts, events]``);
    - ``sglang``: SGLang 0.5 arrays with ``medium`` and a metadata map at position 7, batch
      ``[ts, events, attn_dp_rank]``;
    - ``sglang-map``: SGLang 0.5.2x (#37482) events as maps with ``cache_salt``/``session_id``
      keys, the batch still ``[ts, events, attn_dp_rank]``;
    - ``vllm-0.34``: vLLM 0.34's maps, with ``locality``, ``ownership``, ``session_id`` and
      ``lookahead_token_ids`` on BlockStored (``locality``, ``ownership`` on BlockRemoved);
    - ``sglang-0.5.23``: SGLang 0.5.23's maps, ``lora_name`` last, token ids as ints (up to
      2**62 + 10**6 for multimodal pad values) or, with EAGLE, (token, next token) pairs.
    """
    array_like = kind in ("vllm-positional", "sglang-old", "sglang")
    opts: dict[str, Any] = {"omit_defaults": True, "gc": False, "array_like": array_like, "tag": True}
    hash_t: Any = int | bytes
    if kind.startswith("vllm"):
        stored_fields: list[Any] = [
            ("block_hashes", list[hash_t]),
            ("parent_block_hash", hash_t | None),
            ("token_ids", list[int]),
            ("block_size", int),
            ("lora_id", int | None),
            ("medium", str | None),
            ("lora_name", str | None),
            ("extra_keys", list[Any] | None, _NONE),
            ("group_idx", int | None, _NONE),
            ("kv_cache_spec_kind", str | None, _NONE),
            ("kv_cache_spec_sliding_window", int | None, _NONE),
        ]
        removed_fields: list[Any] = [
            ("block_hashes", list[hash_t]),
            ("medium", str | None),
            ("group_idx", int | None, _NONE),
        ]
        if kind == "vllm-0.34":
            placement = [("locality", str | None, _NONE), ("ownership", str | None, _NONE)]
            stored_fields += [
                *placement,
                ("session_id", str | None, _NONE),
                ("lookahead_token_ids", list[list[int]] | None, _NONE),
            ]
            removed_fields += placement
        batch_fields: list[Any] = [("data_parallel_rank", int | None, _NONE)]
    elif kind == "sglang-old":
        stored_fields = [
            ("block_hashes", list[int]),
            ("parent_block_hash", int | None),
            ("token_ids", list[int]),
            ("block_size", int),
            ("lora_id", int | None),
        ]
        removed_fields = [("block_hashes", list[int])]
        batch_fields = []
    elif kind == "sglang":
        stored_fields = [
            ("block_hashes", list[int]),
            ("parent_block_hash", int | None),
            ("token_ids", list[int]),
            ("block_size", int),
            ("lora_id", int | None),
            ("medium", str | None, _NONE),
            ("metadata", dict[str, Any] | None, _NONE),
        ]
        removed_fields = [("block_hashes", list[int]), ("medium", str | None, _NONE)]
        batch_fields = [("attn_dp_rank", int | None, _NONE)]
    elif kind in ("sglang-map", "sglang-0.5.23"):
        stored_fields = [
            ("block_hashes", list[int]),
            ("parent_block_hash", int | None),
            ("token_ids", list[int] if kind == "sglang-map" else list[Any]),  # 0.5.23: pairs too
            ("block_size", int),
            ("lora_id", int | None),
            ("medium", str | None, _NONE),
            ("cache_salt", str | None, _NONE),
            ("session_id", str | None, _NONE),
        ]
        if kind == "sglang-0.5.23":
            stored_fields.append(("lora_name", str | None, _NONE))
        removed_fields = [("block_hashes", list[int]), ("medium", str | None, _NONE)]
        batch_fields = [("attn_dp_rank", int | None, _NONE)]
    else:
        raise ValueError(kind)
    stored = msgspec.defstruct("BlockStored", stored_fields, **opts)
    removed = msgspec.defstruct("BlockRemoved", removed_fields, **opts)
    cleared = msgspec.defstruct("AllBlocksCleared", [], **opts)
    batch_opts = {k: v for k, v in opts.items() if k != "tag"}
    batch_opts["array_like"] = kind != "vllm-map-batch"  # the batches stayed arrays when events became maps
    batch = msgspec.defstruct(
        "KVEventBatch", [("ts", float), ("events", list[Any]), *batch_fields], **batch_opts
    )
    return {"BlockStored": stored, "BlockRemoved": removed, "AllBlocksCleared": cleared, "Batch": batch}


_encoder = msgspec.msgpack.Encoder()


def encode(obj: Any) -> bytes:
    return _encoder.encode(obj)


class FakeEnginePublisher:
    """One engine rank's publisher as vLLM/SGLang run it: PUB with ``hwm`` bound, an in-memory
    replay buffer of ``buffer_steps`` batches served by a ROUTER (``reply_frames`` 2 = ``[seq,
    payload]``, 3 = ``[topic, seq, payload]``), end marker seq ``-1``. ``send(payload)`` publishes
    the next seq; ``skip(n)`` consumes seqs without sending (an induced gap, still in the
    replay buffer); ``restart()`` starts seqs at 0 again with an empty buffer.
    ``replay_drop=(a, b)``: items ``a..b-1`` of every replay answer are not sent (the end marker
    still is), as a ROUTER drops what goes past its high-water mark while its reader lags."""

    def __init__(
        self,
        ctx: Any,
        pub_endpoint: str,
        replay_endpoint: str | None,
        *,
        topic: bytes = b"kv",
        buffer_steps: int = 10_000,
        reply_frames: int = 3,
        hwm: int = 100_000,
        replay_drop: tuple[int, int] | None = None,
    ) -> None:
        import zmq

        self._zmq = zmq
        self.topic = topic
        self.reply_frames = reply_frames
        self.replay_drop = replay_drop
        self.pub = ctx.socket(zmq.PUB)
        self.pub.set_hwm(hwm)
        self.pub.bind(pub_endpoint)
        self.replay = None
        if replay_endpoint is not None:
            self.replay = ctx.socket(zmq.ROUTER)
            self.replay.bind(replay_endpoint)
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self.seq = 0
        self.replays_served = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if self.replay is not None:
            self._thread = threading.Thread(target=self._serve_replay, daemon=True)
            self._thread.start()

    def send(self, payload: bytes, *, publish: bool = True) -> int:
        with self._lock:
            seq = self.seq
            self.seq += 1
            self.buffer.append((seq, payload))
        if publish:
            self.pub.send_multipart((self.topic, seq.to_bytes(8, "big"), payload))
        return seq

    def restart(self) -> None:
        with self._lock:
            self.seq = 0
            self.buffer.clear()

    def _serve_replay(self) -> None:
        zmq = self._zmq
        assert self.replay is not None
        poller = zmq.Poller()
        poller.register(self.replay, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(50):
                continue
            frames = self.replay.recv_multipart()
            if len(frames) != 3:
                continue
            client, _, start = frames
            start_seq = int.from_bytes(start, "big")
            with self._lock:
                retained = [(s, p) for s, p in self.buffer if s >= start_seq]
            if self.replay_drop is not None:
                a, b = self.replay_drop
                del retained[a:b]
            for s, p in retained:
                body = (
                    [s.to_bytes(8, "big"), p]
                    if self.reply_frames == 2
                    else [self.topic, s.to_bytes(8, "big"), p]
                )
                self.replay.send_multipart([client, b"", *body])
            tail = [END_SEQ, b""] if self.reply_frames == 2 else [self.topic, END_SEQ, b""]
            self.replay.send_multipart([client, b"", *tail])
            self.replays_served += 1

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(2)
        self.pub.close(linger=0)
        if self.replay is not None:
            self.replay.close(linger=0)


def wait_for(predicate: Any, timeout: float = 10.0, interval: float = 0.02) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return bool(predicate())


MEDIA_LEVEL = {"GPU": 0, "CPU": 1, "DISK": 2}


class TrueCacheEngine:
    """A fake engine rank with a true cache (block -> media holding it) that emits the events an
    engine would for its changes: chains stored on GPU, offloads (Stored on CPU then Removed on
    GPU), reloads, evictions per medium, and now and then AllBlocksCleared."""

    def __init__(self, kind: str, rank: int, seed: int, block_size: int = 4) -> None:
        import random

        self.s = engine_structs(kind)
        self.kind = kind
        self.rank = rank
        self.rng = random.Random(seed)
        self.block_size = block_size
        self.held: dict[int, set[str]] = {}
        self.counter = 0
        self.clears = True

    def _new_hash(self) -> int:
        self.counter += 1
        h = (self.rank + 1) << 48 | self.counter
        return -h if self.kind.startswith("sglang") and self.counter % 2 else h  # SGLang: signed int64

    def _stored(self, hashes: list[int], parent: int | None, medium: str) -> Any:
        tokens = [self.rng.randrange(32000) for _ in range(len(hashes) * self.block_size)]
        return self.s["BlockStored"](hashes, parent, tokens, self.block_size, None, medium, None)

    def batch(self, n_events: int = 4) -> bytes:
        events: list[Any] = []
        for _ in range(n_events):
            roll = self.rng.random()
            gpu = [h for h, m in self.held.items() if "GPU" in m]
            cpu_only = [h for h, m in self.held.items() if m == {"CPU"}]
            if roll < 0.45 or not self.held:
                parent = self.rng.choice(gpu) if gpu and self.rng.random() < 0.5 else None
                hashes = [self._new_hash() for _ in range(self.rng.randint(1, 4))]
                events.append(self._stored(hashes, parent, "GPU"))
                for h in hashes:
                    self.held[h] = {"GPU"}
            elif roll < 0.65 and gpu:
                h = self.rng.choice(gpu)
                if "CPU" not in self.held[h]:
                    events.append(self._stored([h], None, "CPU"))
                    self.held[h].add("CPU")
                events.append(self.s["BlockRemoved"]([h], "GPU"))
                self.held[h].discard("GPU")
            elif roll < 0.75 and cpu_only:
                h = self.rng.choice(cpu_only)
                events.append(self._stored([h], None, "GPU"))
                self.held[h].add("GPU")
            elif roll < 0.995:
                h = self.rng.choice(list(self.held))
                medium = self.rng.choice(sorted(self.held[h]))
                events.append(self.s["BlockRemoved"]([h], medium))
                self.held[h].discard(medium)
                if not self.held[h]:
                    del self.held[h]
            elif self.clears:
                events.append(self.s["AllBlocksCleared"]())
                self.held.clear()
        return encode(self.s["Batch"](time.time(), events, self.rank))

    def truth(self) -> dict[int, int]:
        """block hash -> best level held (what the index should show)."""
        return {h & (2**64 - 1): min(MEDIA_LEVEL[m] for m in media) for h, media in self.held.items()}

    def restart(self) -> None:
        self.held.clear()
