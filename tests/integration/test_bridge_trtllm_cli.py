"""``kvevents bridge trtllm --url`` against a local HTTP server answering ``POST /kv_cache_events``
as trtllm-serve does (a JSON list of event dicts), into the real broker."""

from __future__ import annotations

import hashlib
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import ClassVar

from kvevents.consumer import CacheIndex, EventReader, WorkerKey

from kvevents.cli import main


def stored(
    event_id: int, block_hash: int, parent: int | None, rank: int, token_ids: list[int | str] | None = None
) -> dict:
    """``token_ids``: default 0..3; a hex string is a multimodal item's digest (the V2 manager)."""
    tokens = [{"type": "unique_token", "token_id": t, "token_extra_id": 0} for t in (token_ids or range(4))]
    block = {
        "type": "stored_block",
        "block_hash": block_hash,
        "tokens": tokens,
        "cache_level": 0,
        "priority": 35,
    }
    data = {"type": "stored", "parent_hash": parent, "blocks": [block]}
    return {"event_id": event_id, "data": data, "window_size": 0, "attention_dp_rank": rank}


class TrtllmServe(BaseHTTPRequestHandler):
    answers: ClassVar[list[list[dict]]] = []

    def do_POST(self) -> None:
        if self.path != "/kv_cache_events":
            self.send_error(404)
            return
        body = json.dumps(self.answers.pop(0) if self.answers else []).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


def test_bridge_trtllm_polls_trtllm_serve_into_kafka(kafka_bootstrap: str, kafka_topic: str, capsys) -> None:
    digest = hashlib.sha256(b"photo.jpg").hexdigest()
    image: list[int | str] = [7, digest, 152_065, 152_066]
    created = {
        "event_id": 0,
        "data": {"type": "created", "num_blocks_per_cache_level": [64, 0]},
        "window_size": 0,
    }
    TrtllmServe.answers = [
        [dict(created, attention_dp_rank=0), dict(created, attention_dp_rank=1)],
        [stored(1, 11, None, 0), stored(2, 12, 11, 0), stored(1, 21, None, 1), stored(2, 22, 21, 1, image)],
        [
            {
                "event_id": 3,
                "data": {"type": "removed", "block_hashes": [12]},
                "window_size": 0,
                "attention_dp_rank": 0,
            },
            {"event_id": 2, "data": {"type": "bogus"}, "window_size": 0, "attention_dp_rank": 1},
        ],
    ]
    server = ThreadingHTTPServer(("127.0.0.1", 0), TrtllmServe)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        code = main(
            [
                "bridge",
                "trtllm",
                "--url",
                f"http://127.0.0.1:{server.server_port}",
                "--dp-size",
                "2",
                "--instance-id",
                "trt-0",
                "--duration",
                "2",
                "-b",
                kafka_bootstrap,
                "-t",
                kafka_topic,
                "-q",
            ]
        )
    finally:
        server.shutdown()
        server.server_close()
    out = capsys.readouterr().out
    assert code == 0
    summary = json.loads(out)
    assert summary["events"] == 7 and summary["rejected"] == 1 and summary["sink_close"]["clean"]
    index = CacheIndex()
    with EventReader(kafka_bootstrap, kafka_topic) as reader:
        reader.apply_to(index)
    assert [b.block_hash for b in index.worker_blocks(WorkerKey("trt-0", 0), 0)] == [11]
    assert [b.block_hash for b in index.worker_blocks(WorkerKey("trt-0", 1), 0)] == [21, 22]
    extras = [0] * 4 + [0, int(digest[:16], 16), 0, 0]
    tokens = [0, 1, 2, 3, 7, 2**31 - 1, 152_065, 152_066]  # the digest: WIDE_TOKEN_ID
    assert index.find_matches_for_tokens(tokens, 4, token_extra_ids=extras) == {
        WorkerKey("trt-0", 0): 1,  # the same first block's content
        WorkerKey("trt-0", 1): 2,
    }
    assert index.degraded_workers() == []
