"""Mutation fuzzing of the other readers of outside input: a schema-registry consumer's framing
(Confluent messages of the current schema and of v1, and single-object ones, into an index),
``route --serve``'s ``POST /match`` and ``/match/hashes`` answers (whose compiled fast path must
answer exactly as the general path does, and never with a 500), and the TensorRT-LLM event dicts
(whatever ``event_from_trtllm`` accepts must be encodable: a value the schema cannot carry is set
aside there, by name, not later by the sink). ``test_soak.py`` runs them."""

from __future__ import annotations

import hashlib
import json
import random
from functools import partial
from typing import Any

import msgspec
from _mutation import FuzzReport, Reader, fuzz, mutate_value
from _streams import index_batches
from confluent_kafka.schema_registry import Schema, SchemaRegistryClient
from kvevents.consumer import CacheIndex
from kvevents.consumer._framing import index_applier
from kvevents.producer.trtllm import TrtllmDecodeError, event_from_trtllm
from kvevents.schemas import (
    DecodeError,
    EventBatch,
    KVCacheCreatedData,
    KVCacheStoredData,
    LimitError,
    codec,
    decode_batch,
    encode_batch,
)
from kvevents.schemas.registry import RegistryCodec
from schema_v1 import V1_FILE, v1_body

from kvevents.commands._route_app import AppOptions, HttpError, RouteApp, StaticSource


class Finding(Exception):
    """A reader's answer that breaks its contract (not one of its documented errors)."""


# ---------------------------------------------------------------------------- registry framing

SUBJECT = "soak-value"


def registry_stream(seed: int) -> tuple[SchemaRegistryClient, list[bytes]]:
    """A mock registry holding the current schema and v1, and the index stream in three framings
    (Confluent with the current schema's id, Confluent with v1's, single-object) in turn."""
    client = SchemaRegistryClient.new_client({"url": f"mock://soak-{seed}"})
    v1_id = client.register_schema(SUBJECT, Schema(V1_FILE.read_text(), "AVRO"))
    writer = RegistryCodec(client, subject=SUBJECT)
    v1_header = bytes([codec.CONFLUENT_MAGIC]) + v1_id.to_bytes(4, "big")
    messages = []
    for k, batch in enumerate(index_batches(seed)):
        framing = k % 3
        if framing == 0:
            messages.append(writer.encode_batch(batch))
        elif framing == 1 and not any(getattr(e.data, "snapshot", False) for e in batch.events):
            messages.append(v1_header + v1_body(batch))
        else:
            messages.append(encode_batch(batch))
    return client, messages


def registry_reader(client: SchemaRegistryClient) -> Reader:
    """A fresh compiled index behind a reader's framing choice (``index_applier``)."""
    index = CacheIndex(core="compiled")

    def check() -> None:
        index.find_matches([1, 2, 3])
        CacheIndex.from_bytes(index.to_bytes(), core="compiled")

    return index_applier(index, RegistryCodec(client, subject=SUBJECT)), check


def fuzz_registry(seconds: float, seed: int) -> FuzzReport:
    client, messages = registry_stream(seed)
    return fuzz([(partial(registry_reader, client), messages)], (DecodeError, LimitError), seconds, seed)


# ---------------------------------------------------------------------------- route --serve

BLOCK = 4


def _served_index(seed: int) -> tuple[CacheIndex, list[list[int]], list[list[int]]]:
    """The index stream applied; the token runs of its Stored events that start a chain, and
    the engine hashes of all of them."""
    index = CacheIndex(core="compiled")
    tokens, hashes = [], []
    for batch in index_batches(seed):
        index.apply(batch)
        for event in batch.events:
            if isinstance(event.data, KVCacheStoredData):
                if event.data.parent_hash is None:  # a chain from the root: a token query can match it
                    tokens.append([t for block in event.data.blocks for t in block.tokens])
                hashes.append([block.block_hash for block in event.data.blocks])
    return index, tokens, hashes


def route_bodies(seed: int, tokens: list[list[int]], hashes: list[list[int]]) -> dict[str, list[bytes]]:
    """``/match`` and ``/match/hashes`` bodies: stored runs, prefixes and random tokens, one
    prompt or a batch, with and without the optional fields, compact or spaced JSON."""
    rng = random.Random(seed)
    match, by_hash = [], []
    for _ in range(48):

        def run() -> list[int]:
            if rng.random() < 0.7:
                picked = rng.choice(tokens)
                return picked[: rng.randrange(len(picked) + 1)] + [
                    rng.randrange(1 << 17) for _ in range(rng.randrange(3))
                ]
            return [rng.randrange(1 << 31) for _ in range(rng.randrange(12))]

        body: dict[str, Any] = {}
        if rng.random() < 0.6:
            body["token_ids"] = run()
        else:
            body["prompts"] = [
                {"token_ids": run(), **({"lora_id": rng.randrange(1 << 40)} if rng.random() < 0.2 else {})}
                for _ in range(rng.randint(1, 4))
            ]
        for name, value in (
            ("block_size", BLOCK),
            ("lora_id", 3),
            ("window_size", 64),
            ("secondary_weight", 0.5),
        ):
            if rng.random() < 0.2:
                body[name] = value
        separators = rng.choice([(",", ":"), (", ", ": ")])
        match.append(json.dumps(body, separators=separators).encode())
        chain = rng.choice(hashes)
        query: dict[str, Any] = (
            {"block_hashes": chain[: rng.randint(1, len(chain))]}
            if rng.random() < 0.6
            else {"prompts": [{"block_hashes": rng.choice(hashes)} for _ in range(rng.randint(1, 3))]}
        )
        if rng.random() < 0.3:
            query["window_size"] = 64
        by_hash.append(json.dumps(query, separators=separators).encode())
    return {"/match": match, "/match/hashes": by_hash}


def _general(app: RouteApp, raw: bytes) -> tuple[int, bytes]:
    """The general path's answer to a ``/match`` body (its errors as their status and message)."""
    try:
        return 200, app._match_tokens_general(raw)
    except HttpError as exc:
        return exc.status, exc.message.encode()


def route_reader(index: CacheIndex, path: str) -> Reader:
    """One app over the served index: every answer is JSON and not a 500; a ``/match`` answer
    equals the general path's (the same bytes, or the same error status)."""
    app = RouteApp(StaticSource(index), AppOptions(block_size=BLOCK))

    def read(raw: bytes) -> None:
        status, _, body = app.answer_post(path, raw)
        if status >= 500:
            raise Finding(f"{path} answered {status}: {body[:200]!r}")
        try:
            msgspec.json.decode(body)
        except msgspec.DecodeError:
            raise Finding(f"{path} answered {status} with a body that is not JSON: {body[:200]!r}") from None
        if path == "/match":
            general_status, general = _general(app, raw)
            if general_status != status or (status == 200 and general != body):
                raise Finding(f"fast {status} {body[:120]!r} but general {general_status} {general[:120]!r}")

    def check() -> None:
        status, _, _ = app.answer_post("/match", b'{"token_ids":[1,2,3,4]}')
        assert status == 200

    return read, check


def fuzz_route(seconds: float, seed: int) -> FuzzReport:
    index, tokens, hashes = _served_index(seed)
    streams = [
        (partial(route_reader, index, path), bodies)
        for path, bodies in route_bodies(seed, tokens, hashes).items()
    ]
    return fuzz(streams, (), seconds, seed, damage=0.5)


# ---------------------------------------------------------------------------- TensorRT-LLM dicts


def _token(t: int | str, extra: int = 0) -> dict[str, Any]:
    return {"type": "unique_token", "token_id": t, "token_extra_id": extra}


def trtllm_events(seed: int) -> list[dict[str, Any]]:
    """Event dicts as TensorRT-LLM's serializer writes them, old and new shapes (integer and
    hex-digest hashes, mm_keys as maps and pairs, cache salt, LoRA, diffs null or set, the V2
    manager's hex digest in place of a multimodal item's first token id)."""
    rng = random.Random(seed)
    out: list[dict[str, Any]] = []
    for event_id in range(40):
        roll = rng.random()
        digest = rng.random() < 0.3

        def block_hash(digest: bool = digest) -> Any:
            return hashlib.sha256(rng.randbytes(8)).hexdigest() if digest else rng.randrange(-(2**63), 2**64)

        if roll < 0.1:
            data: dict[str, Any] = {
                "type": "created",
                "num_blocks_per_cache_level": [rng.randrange(1 << 16), 64],
            }
        elif roll < 0.3:
            data = {"type": "removed", "block_hashes": [block_hash() for _ in range(rng.randint(0, 4))]}
        elif roll < 0.45:
            diff = {"type": "event_diff", "old_value": 0, "new_value": 1}
            data = {"type": "updated", "block_hash": block_hash(), "cache_level": rng.choice([None, diff]),
                    "priority": rng.choice([None, {"type": "event_diff", "old_value": 35, "new_value": 80}])}  # fmt: skip
        else:
            blocks = []
            for _ in range(rng.randint(1, 3)):
                block: dict[str, Any] = {
                    "type": "stored_block",
                    "block_hash": block_hash(),
                    "tokens": [_token(rng.randrange(1 << 17), rng.choice([0, 0, 9])) for _ in range(4)],
                    "cache_level": rng.choice([0, 1]),
                    "priority": rng.choice([0, 35, 100]),
                }
                if rng.random() < 0.5:  # the newer serializer's fields
                    mm = hashlib.sha256(rng.randbytes(4)).hexdigest()
                    block["mm_keys"] = rng.choice(
                        [[{"type": "mm_key", "hash": mm, "start_offset": 2}], [[mm, 0]], []]
                    )
                    block["cache_salt"] = rng.choice([None, "tenant-a"])
                    block["lora_id"] = rng.choice([None, 7])
                    if rng.random() < 0.5:  # the V2 manager: the item's first token is its digest
                        block["tokens"][2] = _token(mm)
                blocks.append(block)
            data = {"type": "stored", "parent_hash": rng.choice([None, block_hash()]), "blocks": blocks}
        event: dict[str, Any] = {"event_id": event_id, "data": data, "window_size": rng.choice([0, 32, 4096])}
        if rng.random() < 0.5:
            event["attention_dp_rank"] = rng.randrange(4)
        if digest:
            event["hash_algo"] = "v2_sha256"
        out.append(event)
    return out


def trtllm_reader() -> Reader:
    """``event_from_trtllm``: an event it accepts must encode and decode back unchanged."""

    def read(d: Any) -> None:
        event = event_from_trtllm(d)
        batch = EventBatch("trtllm", [event], attention_dp_size=1)
        try:
            back = decode_batch(encode_batch(batch)).events[0]
        except Exception as exc:  # noqa: BLE001 - the finding
            raise Finding(f"accepted but not encodable: {type(exc).__name__}: {exc}") from None
        if back != event and not isinstance(event.data, KVCacheCreatedData):
            raise Finding(f"changed by the round trip: {event!r} -> {back!r}")

    return read, lambda: event_from_trtllm({"event_id": 0, "data": {"type": "removed", "block_hashes": [1]}})


def fuzz_trtllm(seconds: float, seed: int) -> FuzzReport:
    return fuzz(
        [(trtllm_reader, trtllm_events(seed))],
        (TrtllmDecodeError,),
        seconds,
        seed,
        damage=0.6,
        mutator=mutate_value,
    )
