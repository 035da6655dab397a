"""event_from_trtllm against dicts shaped as TensorRT-LLM's KVCacheEventSerializer writes them
(old: no mm_keys/lora_id, updated diffs possibly null; new: mm_key maps, cache_salt, lora_id,
hex v2_sha256 hashes), and the pump / trtllm-serve poller through a real local HTTP server."""

from __future__ import annotations

import hashlib
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import ClassVar

import pytest
from kvevents.producer.trtllm import (
    TrtllmDecodeError,
    TrtllmEventSource,
    event_from_trtllm,
    poll_trtllm_serve,
)
from kvevents.schemas import (
    WIDE_TOKEN_ID,
    DecodeError,
    EventBatch,
    KVCacheCreatedData,
    KVCacheEvent,
    KVCacheEventDiff,
    KVCacheRemovedData,
    KVCacheStoredBlockData,
    KVCacheStoredData,
    KVCacheUpdatedData,
    decode_batch,
    encode_batch,
)


def token(t: int | str, extra: int = 0) -> dict:
    return {"type": "unique_token", "token_id": t, "token_extra_id": extra}


def old_stored(event_id: int = 1) -> dict:
    return {
        "event_id": event_id,
        "data": {
            "type": "stored",
            "parent_hash": None,
            "blocks": [
                {
                    "type": "stored_block",
                    "block_hash": 7,
                    "tokens": [token(1), token(2)],
                    "cache_level": 0,
                    "priority": 35,
                },
                {
                    "type": "stored_block",
                    "block_hash": -3,
                    "tokens": [token(3, 9), token(4)],
                    "cache_level": 1,
                    "priority": 80,
                },
            ],
        },
        "window_size": 4096,
    }


def test_created_removed_updated() -> None:
    created = event_from_trtllm(
        {
            "event_id": 0,
            "data": {"type": "created", "num_blocks_per_cache_level": [100, 50]},
            "window_size": 32,
            "attention_dp_rank": 3,
        }
    )
    assert created == KVCacheEvent(0, KVCacheCreatedData([100, 50]), 32, 3)
    removed = event_from_trtllm(
        {"event_id": 5, "data": {"type": "removed", "block_hashes": [1, 2**64 - 1]}, "window_size": 0}
    )
    assert removed == KVCacheEvent(5, KVCacheRemovedData([1, 2**64 - 1]), 0, None)
    diff = {"type": "event_diff", "new_value": 1, "old_value": 0}
    updated = event_from_trtllm(
        {
            "event_id": 6,
            "data": {"type": "updated", "block_hash": 9, "cache_level": diff, "priority": None},
            "window_size": 0,
        }
    )
    assert updated.data == KVCacheUpdatedData(9, cache_level=KVCacheEventDiff(0, 1), priority=None)


def test_old_stored_shape() -> None:
    event = event_from_trtllm(old_stored())
    assert event.window_size == 4096 and event.attention_dp_rank is None
    a, b = event.data.blocks
    assert a == KVCacheStoredBlockData(7, [1, 2], None, 0, 35)
    assert b.block_hash == 2**64 - 3 and b.cache_level == 1 and b.priority == 80
    assert list(b.token_extra_ids) == [9, 0]


def test_a_lora_name_without_a_lora_id_gives_the_bridges_stable_id() -> None:
    """A stored event naming its adapter (``data.lora_name``, or a block's own) and no
    ``lora_id``: the blocks get the id the ZMQ bridge gives vLLM's ``lora_name``, so the same
    adapter's blocks share one content identity whichever engine stored them."""
    from kvevents.producer.bridge import lora_id_for_name

    d = old_stored()
    d["data"]["lora_name"] = "sql-adapter"
    d["data"]["blocks"][1]["lora_name"] = "other"
    d["data"]["blocks"][0]["lora_id"] = None
    a, b = event_from_trtllm(d).data.blocks
    assert (a.lora_id, b.lora_id) == (lora_id_for_name("sql-adapter"), lora_id_for_name("other"))
    d["data"]["blocks"][0]["lora_id"] = 5  # an id, when given, wins
    assert event_from_trtllm(d).data.blocks[0].lora_id == 5
    d["data"]["lora_name"] = ["not", "a", "name"]
    with pytest.raises(TrtllmDecodeError, match=r"data\.lora_name must be a string or null"):
        event_from_trtllm(d)


def test_new_stored_shape_with_mm_keys_salt_lora_and_hex_hashes() -> None:
    mm = hashlib.sha256(b"img").hexdigest()
    digest = hashlib.sha256(b"block").hexdigest()
    d = {
        "event_id": 10,
        "window_size": 128,
        "attention_dp_rank": 1,
        "hash_algo": "v2_sha256",
        "layer_group_id": 0,
        "data": {
            "type": "stored",
            "parent_hash": "00" * 32,
            "blocks": [
                {
                    "type": "stored_block",
                    "block_hash": digest,
                    "tokens": [token(5)],
                    "cache_level": 0,
                    "priority": 35,
                    "mm_keys": [{"type": "mm_key", "hash": mm, "start_offset": 4}],
                    "cache_salt": "s",
                    "lora_id": 7,
                }
            ],
        },
    }
    event = event_from_trtllm(d)
    block = event.data.blocks[0]
    assert event.data.parent_hash == 0
    assert block.block_hash == int.from_bytes(bytes.fromhex(digest)[:8], "big")
    assert block.mm_keys == ((bytes.fromhex(mm), 4),) and block.cache_salt == "s" and block.lora_id == 7


def _v2_mm_stored(digest: str, event_id: int = 0) -> dict:
    """A Stored event as TensorRT-LLM's V2 manager writes a block holding an image's first
    token: that token's id is the item's content digest in hex, the rest are ints past the
    vocabulary; the same digest keys the block's ``mm_keys``."""
    return {
        "event_id": event_id,
        "attention_dp_rank": 0,
        "layer_group_id": 0,
        "window_size": 64,
        "hash_algo": "v1_block_key",
        "data": {
            "type": "stored",
            "parent_hash": 41,
            "blocks": [
                {
                    "type": "stored_block",
                    "block_hash": 4242 + event_id,
                    "tokens": [token(9), token(digest), token(152_064 + 1)],
                    "cache_salt": None,
                    "cache_level": 0,
                    "priority": 0,
                    "mm_keys": [{"type": "mm_key", "hash": digest, "start_offset": 1}],
                }
            ],
        },
    }


def test_a_v2_multimodal_digest_token_is_read_into_the_extra_id() -> None:
    """It was set aside whole before: the block never reached the index."""
    digest = hashlib.sha256(b"cat.png").hexdigest()
    block = event_from_trtllm(_v2_mm_stored(digest)).data.blocks[0]
    assert list(block.tokens) == [9, WIDE_TOKEN_ID, 152_065]
    assert list(block.token_extra_ids) == [0, int.from_bytes(bytes.fromhex(digest)[:8], "big"), 0]
    assert block.mm_keys == ((bytes.fromhex(digest), 1),)
    again = decode_batch(encode_batch(EventBatch("trt", [event_from_trtllm(_v2_mm_stored(digest))])))
    assert again.events[0].data.blocks[0] == block


def test_two_images_blocks_get_different_content_hashes_even_without_mm_keys() -> None:
    from kvevents.consumer.hashing import content_hash_of_block

    def content(digest: str, with_keys: bool) -> int:
        d = _v2_mm_stored(digest)
        if not with_keys:
            del d["data"]["blocks"][0]["mm_keys"]
        return content_hash_of_block(None, event_from_trtllm(d).data.blocks[0])

    cat, dog = hashlib.sha256(b"cat").hexdigest(), hashlib.sha256(b"dog").hexdigest()
    assert content(cat, True) != content(dog, True)
    assert content(cat, False) != content(dog, False)
    assert content(cat, False) == content(cat.upper(), False)


def test_a_v2_multimodal_block_is_found_by_tokens_and_exported_for_dynamo() -> None:
    from kvevents.consumer import CacheIndex
    from kvevents.consumer.dynamo import stored_block_dict

    digest = hashlib.sha256(b"chart.png").hexdigest()
    created = {
        "event_id": 0,
        "window_size": 64,
        "data": {"type": "created", "num_blocks_per_cache_level": [8]},
    }
    stored = _v2_mm_stored(digest, event_id=1)
    stored["data"]["parent_hash"] = None
    index = CacheIndex()
    index.apply_encoded(
        encode_batch(EventBatch("trt", [event_from_trtllm(created), event_from_trtllm(stored)]))
    )
    block = event_from_trtllm(stored).data.blocks[0]
    found = index.find_matches_for_tokens(
        list(block.tokens), 3, token_extra_ids=list(block.token_extra_ids), mm_keys=[block.mm_keys]
    )
    assert list(found.values()) == [1]
    assert index.find_matches_for_tokens([9, 0, 152_065], 3, mm_keys=[block.mm_keys]) == {}
    assert stored_block_dict(block)["block_hash"] == 4243  # u32 tokens: Dynamo's hash takes it


@pytest.mark.parametrize(
    ("token_id", "extra", "needle"),
    [
        ("not hex", 0, "64-digit hex digest"),
        ("ab" * 31, 0, "64-digit hex digest"),
        ("ab" * 32, 7, "token_extra_id"),
    ],
)
def test_a_string_token_that_is_not_a_digest_is_set_aside_by_name(
    token_id: str, extra: int, needle: str
) -> None:
    d = _v2_mm_stored("cd" * 32)
    d["data"]["blocks"][0]["tokens"][1] = token(token_id, extra)
    with pytest.raises(TrtllmDecodeError) as info:
        event_from_trtllm(d)
    assert "tokens[1].token_id" in str(info.value) and needle in str(info.value)


@pytest.mark.parametrize(
    ("d", "needle"),
    [
        ([], "dict"),
        ({"data": {"type": "removed", "block_hashes": []}}, "event_id"),
        ({"event_id": 1, "data": None}, "data must be a dict"),
        ({"event_id": 1, "data": {"type": "bogus"}}, "bogus"),
        ({"event_id": 1, "data": {"type": "removed", "block_hashes": ["zz"]}}, "block_hashes[0]"),
        (
            {"event_id": 1, "data": {"type": "stored", "parent_hash": None, "blocks": [{"tokens": []}]}},
            "block_hash",
        ),
        (
            {
                "event_id": 1,
                "data": {
                    "type": "stored",
                    "parent_hash": None,
                    "blocks": [{"block_hash": 1, "tokens": [token(2**40)]}],
                },
            },
            "token_id",
        ),
        ({"event_id": 1, "data": {"type": "updated", "block_hash": 1, "cache_level": 3}}, "cache_level"),
        ({"event_id": -1, "data": {"type": "removed", "block_hashes": []}}, "event_id"),
        ({"event_id": 1, "data": {"type": "created", "num_blocks_per_cache_level": 5}}, "num_blocks"),
        (
            {
                "event_id": 1,
                "data": {"type": "stored", "parent_hash": None, "blocks": [{"block_hash": 1, "mm_keys": 5}]},
            },
            "mm_keys",
        ),
        (
            {
                "event_id": 1,
                "data": {
                    "type": "stored",
                    "parent_hash": None,
                    "blocks": [{"block_hash": 1, "mm_keys": [[[1, 2, 3], 0]]}],
                },
            },
            "32 bytes",
        ),
    ],
)
def test_bad_dicts_raise_naming_the_field(d, needle: str) -> None:
    with pytest.raises(TrtllmDecodeError) as info:
        event_from_trtllm(d)
    assert needle in str(info.value) and isinstance(info.value, DecodeError)


def _removed(**fields: object) -> dict:
    return {"event_id": 1, "data": {"type": "removed", "block_hashes": [1]}, **fields}


def _salted(salt: object) -> dict:
    block = {"block_hash": 1, "tokens": [token(2)], "cache_salt": salt}
    return {"event_id": 1, "data": {"type": "stored", "parent_hash": None, "blocks": [block]}}


@pytest.mark.parametrize(
    ("d", "needle"),
    [
        (_removed(event_id=2**63), "event_id"),
        (_removed(window_size=2**31), "window_size"),
        (_removed(attention_dp_rank=2**31), "attention_dp_rank"),
        (
            {"event_id": 1, "data": {"type": "created", "num_blocks_per_cache_level": [1, 2**31]}},
            "num_blocks_per_cache_level[1]",
        ),
        (_salted("\udc80"), "cache_salt"),
    ],
)
def test_values_the_schema_cannot_carry_are_set_aside_by_name(d: dict, needle: str) -> None:
    """Found by fuzzing (make soak): these were accepted, and only the sink's encoding failed
    on them later, far from the engine's dict."""
    with pytest.raises(TrtllmDecodeError) as info:
        event_from_trtllm(d)
    assert needle in str(info.value)


@pytest.mark.parametrize(
    ("text", "key"),
    [
        ("sku-1234", b"sku-1234".ljust(32, b"\0")),  # TensorRT-LLM's uuid_to_hash: zero-padded
        ("x" * 32, b"x" * 32),
        ("y" * 33, hashlib.sha256(b"y" * 33).digest()),  # longer than a key: hashed
        ("\u6d4b\u8bd5-uuid", "\u6d4b\u8bd5-uuid".encode().ljust(32, b"\0")),
        ("ab" * 32, bytes.fromhex("ab" * 32)),  # a hex digest, as without a UUID
        ("0x" + "cd" * 32, bytes.fromhex("cd" * 32)),
    ],
)
def test_an_mm_key_written_as_its_uuid_is_read(text: str, key: bytes) -> None:
    """With ``multimodal_uuids``, TensorRT-LLM's serializer writes the item's UUID where the hex
    digest goes; the event was set aside whole before."""
    block = {
        "block_hash": 1,
        "tokens": [token(2)],
        "mm_keys": [{"type": "mm_key", "hash": text, "start_offset": 3}],
    }
    event = event_from_trtllm(
        {"event_id": 1, "data": {"type": "stored", "parent_hash": None, "blocks": [block]}}
    )
    assert event.data.blocks[0].mm_keys == ((key, 3),)


def test_the_largest_values_the_schema_carries_are_accepted() -> None:
    event = event_from_trtllm(
        _removed(event_id=2**63 - 1, window_size=2**31 - 1, attention_dp_rank=2**31 - 1)
    )
    assert decode_batch(encode_batch(EventBatch("t", [event]))).events == [event]
    assert event_from_trtllm(_salted(12)).data.blocks[0].cache_salt == "12"


class FakeLLM:
    """An ``LLM``-like object: ``get_kv_cache_events(timeout)`` hands out queued dicts."""

    def __init__(self, batches: list[list[dict]]) -> None:
        self.batches = list(batches)
        self.calls = 0

    def get_kv_cache_events(self, timeout: float = 2) -> list[dict]:
        self.calls += 1
        if self.batches:
            return self.batches.pop(0)
        time.sleep(min(timeout, 0.01))
        return []


def drain_all(source: TrtllmEventSource, want: int, timeout: float = 5.0):
    events, dropped = [], []
    deadline = time.monotonic() + timeout
    while len(events) < want and time.monotonic() < deadline:
        d = source.drain(0.05)
        events += d.events
        dropped += d.dropped
    return events, dropped


def test_pump_drains_an_llm_and_sets_bad_dicts_aside() -> None:
    llm = FakeLLM(
        [
            [old_stored(0), {}, {"event_id": 1, "data": {"type": "nope"}}],
            [{"event_id": 2, "data": {"type": "removed", "block_hashes": [7]}, "window_size": 4096}],
        ]
    )
    source = TrtllmEventSource(llm.get_kv_cache_events, fetch_timeout=0.01)
    try:
        events, dropped = drain_all(source, 2)
        assert [e.event_id for e in events] == [0, 2] and dropped == []
        assert source.stats()["rejected"] == 1 and "nope" in source.rejected[0][0]
    finally:
        source.close()


def test_pump_bounded_drops_oldest_counted_per_rank() -> None:
    batch = [
        {
            "event_id": i,
            "data": {"type": "removed", "block_hashes": [i]},
            "window_size": 0,
            "attention_dp_rank": 1,
        }
        for i in range(10)
    ]
    source = TrtllmEventSource(FakeLLM([batch]).get_kv_cache_events, max_events=4, fetch_timeout=0.01)
    try:
        time.sleep(0.2)
        d = source.drain(0.5)
        assert [e.event_id for e in d.events] == [6, 7, 8, 9]
        assert [(r.attention_dp_rank, r.dropped_events) for r in d.dropped] == [(1, 6)]
    finally:
        source.close()


class _Serve(BaseHTTPRequestHandler):
    queue: ClassVar[list[list[dict]]] = []
    posts = 0

    def do_POST(self) -> None:
        type(self).posts += 1
        body = json.dumps(self.queue.pop(0) if self.queue else []).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


def test_trtllm_serve_poller_against_a_local_http_server() -> None:
    _Serve.queue = [
        [old_stored(0)],
        [{"event_id": 1, "data": {"type": "removed", "block_hashes": [7]}, "window_size": 4096}],
    ]
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Serve)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    source = TrtllmEventSource(poll_trtllm_serve(f"http://127.0.0.1:{server.server_port}"), idle_sleep=0.01)
    try:
        events, _ = drain_all(source, 2)
        assert [e.event_id for e in events] == [0, 1]
        assert isinstance(events[0].data, KVCacheStoredData) and len(events[0].data.blocks) == 2
        assert _Serve.posts >= 2
    finally:
        source.close()
        server.shutdown()
        server.server_close()


def test_poller_counts_fetch_errors_without_dying() -> None:
    source = TrtllmEventSource(poll_trtllm_serve("http://127.0.0.1:9", http_timeout=0.2), fetch_timeout=0.05)
    try:
        deadline = time.monotonic() + 5
        while source.stats().get("fetch_errors", 0) < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert source.stats()["fetch_errors"] >= 1
    finally:
        source.close()
