"""The baseline of ``bench/route_serve.py``: the threaded ``http.server`` that ``route --serve`` ran
on until it moved to uvicorn, kept as it was so that both are measured in one run.

- ``POST /match`` with ``{"token_ids": [...], "block_size": 32, "lora_id": null}`` (optional
  ``secondary_weight`` 0..1, ``window_size``) answers ``{"blocks": n, "scores": [{"instance_id",
  "attention_dp_rank", "matched_blocks", "primary_blocks", "score"}...], "best": {...} | null}``,
  best first; a bad body gets 400 ``{"error": "..."}``;
- ``GET /healthz``: ``{"status": "ok", "caught_up", "workers", "degraded_workers", "lag_messages", ...}``;
- ``GET /workers``: every worker's blocks per window and level, degraded flag, and a summary.

A background thread keeps applying the topic to the index (:class:`IndexFollower`); the index
is not thread-safe, so the follower and the request handlers share one lock.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Any

from kvevents.commands._routing import parse_match_request, score_prompt

if TYPE_CHECKING:
    from kvevents.consumer import CacheIndex, EventReader

__all__ = ["IndexFollower", "MatchServer"]

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 16 * 1024 * 1024


class IndexFollower:
    """Applies the topic to the index in a background thread, under ``lock``; keeps the
    reader's figures in :attr:`status` (the reader itself is used only by this thread)."""

    def __init__(
        self, index: CacheIndex, reader: EventReader, lock: threading.Lock, poll_s: float = 0.5
    ) -> None:
        self.index = index
        self.reader = reader
        self.lock = lock
        self.poll_s = poll_s
        self.error: str | None = None
        self._stop = threading.Event()
        self._status: dict[str, Any] = {}
        self._status_lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="kvevents-route-follower", daemon=True)

    def start(self) -> None:
        self._record()
        self._thread.start()

    def _record(self) -> None:
        metrics = self.reader.metrics()
        with self._status_lock:
            self._status = {
                "caught_up": metrics.caught_up,
                "lag_messages": metrics.lag_total,
                "messages": metrics.messages_total,
                "events": metrics.events_total,
                "malformed": metrics.malformed_total,
                "kafka_errors": metrics.errors_total,
                "updated_at": time.time(),
            }

    @property
    def status(self) -> dict[str, Any]:
        with self._status_lock:
            return dict(self._status)

    def _run(self) -> None:
        from confluent_kafka import KafkaException
        from kvevents.consumer import ReaderError

        try:
            while not self._stop.is_set():
                self.reader.apply_to(self.index, until_caught_up=False, timeout=self.poll_s, lock=self.lock)
                self._record()
        except (ReaderError, KafkaException, RuntimeError, ValueError, OSError) as exc:  # /healthz reports it
            self.error = f"{type(exc).__name__}: {exc}"
            log.error("the index stopped following the topic: %s", self.error)

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self.reader.stop()
        self._thread.join(timeout)


class MatchServer(ThreadingHTTPServer):
    """The HTTP server; handlers reach the index, its lock and the follower through it."""

    daemon_threads = True

    def __init__(
        self,
        address: tuple[str, int],
        index: CacheIndex,
        lock: threading.Lock,
        follower: IndexFollower | None,
        default_block_size: int,
    ) -> None:
        super().__init__(address, _Handler)
        self.index = index
        self.lock = lock
        self.follower = follower
        self.default_block_size = default_block_size
        self.requests_served = 0
        self._count_lock = threading.Lock()

    def count(self) -> None:
        with self._count_lock:
            self.requests_served += 1

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        name = host.decode() if isinstance(host, bytes) else str(host)
        return f"http://{name}:{port}"


class _Handler(BaseHTTPRequestHandler):
    server: MatchServer
    protocol_version = "HTTP/1.1"
    # Headers and body go out in two writes; with Nagle on, a keep-alive client's delayed ACK
    # held every answer ~40 ms (measured: bench/route_serve.py).
    disable_nagle_algorithm = True

    def log_message(self, format: str, *args: Any) -> None:
        log.info("%s %s", self.address_string(), format % args)

    def _send(self, status: HTTPStatus, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        self.server.count()  # before the answer leaves: a client that got it sees it counted
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        from kvevents.commands._workers_view import index_summary, worker_rows

        path = self.path.split("?", 1)[0]
        if path == "/healthz":
            with self.server.lock:
                workers = self.server.index.workers()
                degraded = len(self.server.index.degraded_workers())
            follower = self.server.follower
            body: dict[str, Any] = {"status": "ok", "workers": len(workers), "degraded_workers": degraded}
            if follower is not None:
                body.update(follower.status)
                if follower.error:
                    body.update(status="error", error=follower.error)
            self._send(HTTPStatus.OK if body["status"] == "ok" else HTTPStatus.SERVICE_UNAVAILABLE, body)
        elif path == "/workers":
            with self.server.lock:
                body = {
                    "workers": worker_rows(self.server.index),
                    "summary": index_summary(self.server.index),
                }
            self._send(HTTPStatus.OK, body)
        else:
            self._send(
                HTTPStatus.NOT_FOUND,
                {"error": f"no such path {path!r}: GET /healthz, GET /workers, POST /match"},
            )

    def do_POST(self) -> None:
        path = self.path.split("?", 1)[0]
        if path != "/match":
            self._send(HTTPStatus.NOT_FOUND, {"error": f"no such path {path!r}: POST /match"})
            return
        try:
            length = int(self.headers.get("Content-Length", ""))
        except ValueError:
            self._send(HTTPStatus.LENGTH_REQUIRED, {"error": "a Content-Length header is required"})
            return
        if length > MAX_BODY_BYTES:
            self.close_connection = True
            self._send(
                HTTPStatus.REQUEST_ENTITY_TOO_LARGE, {"error": f"body larger than {MAX_BODY_BYTES} bytes"}
            )
            return
        raw = self.rfile.read(length)
        try:
            request = parse_match_request(raw, self.server.default_block_size)
        except ValueError as exc:
            self._send(HTTPStatus.BAD_REQUEST, {"error": str(exc)})
            return
        with self.server.lock:
            blocks, scores = score_prompt(
                self.server.index,
                request.token_ids,
                request.block_size,
                request.lora_id,
                secondary_weight=request.secondary_weight,
                window_size=request.window_size,
            )
        rows = [s.to_json() for s in scores]
        self._send(HTTPStatus.OK, {"blocks": blocks, "scores": rows, "best": rows[0] if rows else None})
