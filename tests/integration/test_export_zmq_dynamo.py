"""``kvevents export zmq`` read by NVIDIA Dynamo's own standalone KV indexer (``python -m
dynamo.indexer`` from ai-dynamo-runtime, the bench-dynamo extra CI installs), which subscribes to
vLLM-format ZMQ publishers and answers ``/query`` with its own hashing: a real topic, the real
exporter (one publisher per worker, its default event encoding), Dynamo's binary.

What it pins: events as arrays decode; a hash below 2**32 (written as an 8-byte uint64) keeps
its batch; an adapter's blocks are found under its name, an unnamed id's under the id's decimal
string and never as the base model's; a block moved to host memory stops a device match; a
removal, a data-parallel rank's own stream and a Created (AllBlocksCleared) are applied."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kafka_streams import produce
from kvevents.consumer import WorkerKey
from kvevents.consumer.export.zmq_export import Endpoint, ZmqExportConfig, ZmqExporter
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

pytestmark = pytest.mark.kafka

BLOCK = 4
MODEL = "meta-llama/Llama-3.1-8B"


def _tokens(first: int, blocks: int) -> list[list[int]]:
    return [[first + BLOCK * b + i for i in range(BLOCK)] for b in range(blocks)]


TEXT, NAMED, UNNAMED, RANK1, CLEARED = (
    _tokens(1000 * k, n) for k, n in ((1, 4), (2, 2), (3, 2), (4, 2), (5, 2))
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _stored(eid: int, hashes: list[int], tokens: list[list[int]], rank: int = 0, **kw: Any) -> KVCacheEvent:
    blocks = [KVCacheStoredBlockData(h, t, **kw) for h, t in zip(hashes, tokens, strict=True)]
    return KVCacheEvent(eid, KVCacheStoredData(None, blocks), 0, rank)


def _batches() -> list[EventBatch]:
    text = [0xDEAD_BEEF, 0xF000_0000_0000_0001, 0x9E37_79B9_7F4A_7C15, 0x1234_5678_9ABC_DEF0]
    engine = [
        KVCacheEvent(0, KVCacheCreatedData([1000]), 0, 0),
        _stored(1, text, TEXT),  # the first hash below 2**32
        _stored(2, [0x2001_0000_0000, 0x2002_0000_0000], NAMED, lora_id=7),
        _stored(3, [0x3001_0000_0000, 0x3002_0000_0000], UNNAMED, lora_id=9),
        KVCacheEvent(4, KVCacheUpdatedData(text[1], cache_level=KVCacheEventDiff(0, 1)), 0, 0),
        KVCacheEvent(5, KVCacheRemovedData([text[3]]), 0, 0),
        KVCacheEvent(0, KVCacheCreatedData([1000]), 0, 1),
        _stored(1, [0x4001_0000_0000, 0x4002_0000_0000], RANK1, rank=1),
    ]
    other = [
        KVCacheEvent(0, KVCacheCreatedData([1000]), 0, 0),
        _stored(1, [0x5001_0000_0000, 0x5002_0000_0000], CLEARED),
        KVCacheEvent(2, KVCacheCreatedData([1000]), 0, 0),  # reset: its blocks are gone
    ]
    return [
        EventBatch("engine", engine, attention_dp_size=2, producer_id=1, sequence=0),
        EventBatch("other", other, producer_id=2, sequence=0),
    ]


def _query(port: int, tokens: list[list[int]], lora_name: str | None = None) -> dict[str, dict[str, int]]:
    body: dict[str, Any] = {"token_ids": [t for block in tokens for t in block], "model_name": MODEL}
    if lora_name is not None:
        body["lora_name"] = lora_name
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/query", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=5) as response:
        scores: dict[str, dict[str, int]] = json.loads(response.read()).get("scores", {})
    return scores


@pytest.fixture
def dynamo_indexer(tmp_path: Path) -> Iterator[tuple[int, dict[WorkerKey, int]]]:
    """Dynamo's indexer subscribed to three publishers, one per worker (Dynamo takes one worker
    and one seq counter per socket): (its HTTP port, the publishers' ports)."""
    import dynamo.llm  # noqa: F401  (ai-dynamo-runtime: missing, the test fails, it does not skip)

    http = _free_port()
    pubs = {
        WorkerKey("engine", 0): _free_port(),
        WorkerKey("engine", 1): _free_port(),
        WorkerKey("other", 0): _free_port(),
    }
    ids = {WorkerKey("engine", 0): "1", WorkerKey("engine", 1): "1:1", WorkerKey("other", 0): "2"}
    workers = ",".join(f"{ids[key]}=tcp://127.0.0.1:{port}" for key, port in pubs.items())
    log = tmp_path / "indexer.log"
    with log.open("w") as out:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "dynamo.indexer",
                "--block-size",
                str(BLOCK),
                "--port",
                str(http),
                "--threads",
                "1",
                "--model-name",
                MODEL,
                "--workers",
                workers,
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                _query(http, TEXT)
                break
            except (urllib.error.URLError, ConnectionError) as exc:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise AssertionError(
                        f"Dynamo's indexer did not answer: {exc}\n{log.read_text()[-3000:]}"
                    ) from exc
                time.sleep(0.1)
        yield http, pubs
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=10)


def test_dynamos_own_indexer_reads_the_export(
    kafka_bootstrap: str, kafka_topic: str, dynamo_indexer: tuple[int, dict[WorkerKey, int]]
) -> None:
    http, pubs = dynamo_indexer
    produce(kafka_bootstrap, kafka_topic, _batches())
    config = ZmqExportConfig(
        kafka_bootstrap,
        kafka_topic,
        workers={key: (Endpoint(f"tcp://127.0.0.1:{port}"), None) for key, port in pubs.items()},
        model=MODEL,
        lora_names={7: "sql-lora"},
        start_delay_s=1.0,  # the indexer's SUBs reconnect to the binds and subscribe
    )
    with ZmqExporter(config) as exporter:
        exporter.run(until_caught_up=True)
        assert exporter.stats.batches_published == 3 and exporter.stats.malformed == 0  # a batch per worker
    expected = [
        ("the text: block 2 moved to host memory, so 1 device block", TEXT, None, "1", "0", 1),
        ("an adapter's blocks, under its name", NAMED, "sql-lora", "1", "0", 2),
        ("the same tokens as the base model's: no hit", NAMED, None, "1", "0", 0),
        ("an unnamed adapter id, under its decimal string", UNNAMED, "9", "1", "0", 2),
        ("an unnamed adapter's blocks are no base-model hit", UNNAMED, None, "1", "0", 0),
        ("rank 1's own stream", RANK1, None, "1", "1", 2),
        ("an instance reset by a Created event", CLEARED, None, "2", "0", 0),
    ]
    deadline = time.monotonic() + 15  # the indexer applies what it received asynchronously
    while True:
        got = [
            (name, _query(http, t, lora).get(w, {}).get(dp, 0) // BLOCK)
            for name, t, lora, w, dp, _ in expected
        ]
        want = [(name, blocks) for name, _, _, _, _, blocks in expected]
        if got == want or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert got == want
