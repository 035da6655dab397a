"""Soak targets for the readers of engines' and Kafka's bytes: the ZMQ bridge's converter (vLLM
and SGLang payloads, compiled and Python paths) and the index's ``apply_encoded`` (Kafka message
values, compiled codec and core). Each may raise only its documented errors and must keep
working (``test_soak.py`` runs them)."""

from __future__ import annotations

import random
from functools import partial
from typing import Any

from _mutation import FuzzReport, Reader, fuzz
from _streams import index_batches
from bridge_engines import encode, engine_structs
from bridge_payloads import KINDS
from kvevents.consumer import CacheIndex
from kvevents.producer.bridge import BridgeDecodeError, ZmqEventConverter
from kvevents.producer.sink_encoded import EncodedEvents
from kvevents.schemas import (
    DecodeError,
    LimitError,
    encode_batch,
)

BRIDGE_KINDS = KINDS  # every engine encoding the differential tests know

# ---------------------------------------------------------------------------- the bridge


def _hashes(rng: random.Random, kind: str) -> list[Any]:
    """Engine block hashes: unsigned or signed ints, and for vLLM also 32-byte digests."""
    n = rng.randint(1, 6)
    if kind.startswith("vllm") and rng.random() < 0.3:
        return [rng.randbytes(32) for _ in range(n)]
    if rng.random() < 0.2:
        return [rng.randrange(-(2**63), 2**63) for _ in range(n)]
    return [rng.getrandbits(63) for _ in range(n)]


def _engine_event(rng: random.Random, s: dict[str, Any], kind: str) -> Any:
    """A Cleared, Removed or Stored event of ``kind``'s encoding, now and then with the rarer
    fields (media, LoRA, extra keys, KV-cache groups and sliding windows, SGLang metadata)."""
    roll = rng.random()
    hashes = _hashes(rng, kind)
    rare = rng.random() < 0.4
    medium = rng.choice(["GPU", "CPU", "cpu", "DISK", None]) if rare else rng.choice(["GPU", None])
    if roll < 0.1:
        return s["AllBlocksCleared"]()
    if roll < 0.35:
        if kind == "sglang-old":
            return s["BlockRemoved"](hashes)
        if kind.startswith("vllm"):
            return s["BlockRemoved"](hashes, medium, rng.choice([None, 0, 1]) if rare else None)
        return s["BlockRemoved"](hashes, medium)
    if kind == "vllm-0.34" and rare and rng.random() < 0.3:  # an offloading placeholder
        return s["BlockStored"](hashes[:1], None, [], 0, None, rng.choice(["CPU", "STORAGE"]), None)
    size = rng.choice([1, 2, 4, 16])
    n_tokens = len(hashes) * size - (rng.randrange(size) if rare else 0)
    tokens: list[Any] = [rng.randrange(200_000) for _ in range(n_tokens)]
    if kind == "sglang-0.5.23" and rare:
        if rng.random() < 0.5:  # multimodal pad values, 62 bits past 10**6
            tokens = [10**6 + rng.getrandbits(62) if rng.random() < 0.5 else t for t in tokens]
        else:  # EAGLE's bigram keys: (token, next token)
            tokens = [[t, rng.randrange(200_000)] for t in tokens]
    parent = rng.choice([None, rng.getrandbits(63)])
    lora_id = rng.choice([None, rng.randrange(1, 50)]) if rare else None
    args: list[Any] = [hashes, parent, tokens, size, lora_id]
    if kind.startswith("vllm"):
        mm = rng.randbytes(32).hex()
        keys = [  # raw tuples (digests, pairs, bare identifiers, a salt) and vLLM's typed maps
            None,
            [rng.randbytes(32)],
            [(rng.randbytes(32), 0)],
            ["adapter", "sku-1", mm, "tenant"],
            [
                {"type": "mm", "modality": "image", "hash": mm, "block_offset": -1},
                {"type": "cache_salt", "salt": "s"},
            ],
            [
                {"type": "lora", "name": "adapter"},
                {"type": "prompt_embeds", "hash": b"x" * 32},
                {"type": "legacy", "value": [mm, 2]},
            ],
        ]
        extra = [rng.choice(keys) for _ in hashes] if rare else None
        window = rng.choice([None, 128, 4096]) if rare else None
        args += [medium, rng.choice([None, "adapter"]) if lora_id else None, extra]
        args += [rng.choice([None, 0, 1]) if rare else None, "sliding_window" if window else None, window]
    elif kind == "sglang":
        meta = {"cache_salt": "s1", "lora_name": "adapter"} if rare and rng.random() < 0.5 else None
        args += [medium, meta]
    elif kind == "sglang-map":
        args += [medium, rng.choice([None, "s1"]) if rare else None, None]
    elif kind == "sglang-0.5.23":
        args += [medium, rng.choice([None, "s1"]) if rare else None, None, rng.choice([None, "adapter"])]
    return s["BlockStored"](*args)


def bridge_streams(seed: int) -> list[tuple[str, list[bytes]]]:
    """Per engine encoding, 24 payloads of 1-6 events (rank 0 or none)."""
    rng = random.Random(seed)
    out = []
    for kind in BRIDGE_KINDS:
        s = engine_structs(kind)
        payloads = []
        for _ in range(24):
            events = [_engine_event(rng, s, kind) for _ in range(rng.randint(1, 6))]
            batch = s["Batch"](1.5, events) if kind == "sglang-old" else s["Batch"](1.5, events, 0)
            payloads.append(encode(batch))
        out.append(("sglang" if kind.startswith("sglang") else "vllm", payloads))
    return out


def bridge_reader(engine: str) -> Reader:
    """A fresh converter: the pre-encoded path first, then ``convert`` for what it leaves."""
    conv = ZmqEventConverter(engine)

    def read(payload: bytes) -> None:
        if not conv.convert_encoded(payload, EncodedEvents()):
            conv.convert(payload)

    return read, conv.to_state


def fuzz_bridge(seconds: float, seed: int) -> FuzzReport:
    streams = [(partial(bridge_reader, engine), payloads) for engine, payloads in bridge_streams(seed)]
    return fuzz(streams, (BridgeDecodeError,), seconds, seed)


# ---------------------------------------------------------------------------- the index


def index_stream(seed: int) -> list[bytes]:
    """:func:`index_batches`, encoded (single-object framing)."""
    return [encode_batch(batch) for batch in index_batches(seed)]


def index_reader() -> Reader:
    """A fresh compiled index; its check queries it and round-trips its state."""
    index = CacheIndex(core="compiled")

    def check() -> None:
        index.find_matches([1, 2, 3])
        CacheIndex.from_bytes(index.to_bytes(), core="compiled")

    return index.apply_encoded, check


def fuzz_index(seconds: float, seed: int) -> FuzzReport:
    # the 10-byte single-object header is damaged one time in ten (keep=10)
    return fuzz([(index_reader, index_stream(seed))], (DecodeError, LimitError), seconds, seed, keep=10)
