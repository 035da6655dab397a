"""The ASGI application of ``route --serve`` (bare ASGI, msgspec JSON; no framework): routes,
body limits enforced before and while reading, JSON errors with the right status everywhere,
the endpoints, and ``/metrics``. Served by :mod:`._route_http` (uvicorn)."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import msgspec

from kvevents.commands._route_answer import FastAnswers
from kvevents.commands._route_metrics import RequestMetrics, match_form, render
from kvevents.commands._route_requests import HASH_MAX, MAX_BATCH, HashesBody, MatchBody, score_query

if TYPE_CHECKING:
    from kvevents.consumer import CacheIndex, FollowerHealth, Liveness, ReaderMetrics, WorkerKey

    from kvevents.commands._route_gc import GcPauses

__all__ = ["AppOptions", "HttpError", "IndexSource", "RouteApp", "StaticSource"]

log = logging.getLogger(__name__)

Send = Callable[[dict[str, Any]], Awaitable[None]]
Receive = Callable[[], Awaitable[dict[str, Any]]]
_JSON = [(b"content-type", b"application/json")]
_encode = msgspec.json.Encoder().encode


class IndexSource(Protocol):
    """What the app serves from: a :class:`~kvevents.consumer.LiveIndex`, or a fixed index."""

    index: CacheIndex
    lock: threading.Lock

    @property
    def liveness(self) -> Liveness | None: ...

    def health(self) -> FollowerHealth | None: ...
    def not_routable(self, now: float | None = None) -> dict[WorkerKey, str]: ...
    def metrics(self) -> ReaderMetrics | None: ...


class StaticSource:
    """A fixed index (benchmarks, tests): always ready, every worker live."""

    liveness: Liveness | None = None

    def __init__(self, index: CacheIndex) -> None:
        self.index = index
        self.lock = threading.Lock()

    def health(self) -> None:
        return None

    def not_routable(self, now: float | None = None) -> dict[WorkerKey, str]:
        return {}

    def metrics(self) -> None:
        return None


@dataclass(frozen=True)
class AppOptions:
    block_size: int = 32
    max_body_bytes: int = 4 * 1024 * 1024
    process: int = 0


class HttpError(Exception):
    def __init__(self, status: int, message: str, *, close: bool = False, headers: list[tuple[bytes, bytes]] | None = None) -> None:  # fmt: skip
        super().__init__(message)
        self.status = status
        self.message = message
        self.close = close
        self.headers = headers or []


_ROUTES: dict[str, tuple[str, ...]] = {
    "/match": ("POST",),
    "/match/hashes": ("POST",),
    "/workers": ("GET", "HEAD"),
    "/healthz": ("GET", "HEAD"),
    "/readyz": ("GET", "HEAD"),
    "/metrics": ("GET", "HEAD"),
}
_MATCH_ROUTES = frozenset(("/match", "/match/hashes"))
_ROUTE_LIST = "POST /match, POST /match/hashes, GET /workers, GET /healthz, GET /readyz, GET /metrics"
_EXCLUSIONS_TTL_S = 0.2
_ROWS_PER_HOLD = 256
"""GET /workers builds this many rows per hold of the index lock (10 us a row: 2.6 ms a hold;
all 32,768 workers' rows in one hold took 348 ms)."""


def _results(parts: list[bytes], batch: bool) -> bytes:
    """A batch's answers as ``{"results": [...]}``; the one prompt's answer as is."""
    return b'{"results":[' + b",".join(parts) + b"]}" if batch else parts[0]


class RouteApp:
    """``await app(scope, receive, send)``; see the module docstring and README for the API."""

    gc_pauses: GcPauses | None = None  # set by the serving process: GC figures in /metrics

    def __init__(self, source: IndexSource, options: AppOptions | None = None) -> None:
        self.source = source
        self.options = options or AppOptions()
        self.requests = RequestMetrics()
        self.started = time.time()
        self._exclusions: tuple[float, dict[Any, str], frozenset[Any]] = (-1e9, {}, frozenset())
        self._fast = FastAnswers(source.index, self.options.block_size)

    async def __call__(self, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind == "lifespan":
            await self._lifespan(receive, send)
            return
        if kind != "http":
            return
        started = time.perf_counter()
        path = scope["path"]
        route = path if path in _ROUTES else "other"
        try:
            status, body, content_type = await self._handle(scope, receive, path)
            headers = [(b"content-type", content_type)]
        except Exception as exc:  # every failure answers JSON; a bug is logged and answers 500
            if not isinstance(exc, HttpError):
                log.exception("%s %s failed", scope["method"], path)
            status, headers, body = self._error(exc)
        headers.append((b"content-length", str(len(body)).encode()))
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": b"" if scope["method"] == "HEAD" else body})
        form = match_form(status, body) if route in _MATCH_ROUTES else ""
        self.requests.observe(route, status, time.perf_counter() - started, form)

    def answer_post(self, path: str, raw: bytes) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
        """``POST /match`` or ``/match/hashes`` with its whole body read and its Content-Length
        already checked (the protocol's direct path, :mod:`._route_http`): status, headers and
        body as :meth:`__call__` answers them, counted in the metrics alike."""
        started = time.perf_counter()
        try:
            body = self._match_tokens(raw) if path == "/match" else self._match_hashes(raw)
            status, headers = 200, [(b"content-type", b"application/json")]
        except Exception as exc:  # as in __call__
            if not isinstance(exc, HttpError):
                log.exception("POST %s failed", path)
            status, headers, body = self._error(exc)
        headers.append((b"content-length", str(len(body)).encode()))
        self.requests.observe(path, status, time.perf_counter() - started, match_form(status, body))
        return status, headers, body

    @staticmethod
    def _error(exc: Exception) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
        """The JSON answer to a failure; a bug (not an :class:`HttpError`) answers 500."""
        if not isinstance(exc, HttpError):
            exc = HttpError(500, f"internal error: {type(exc).__name__}: {exc}", close=True)
        headers = [*_JSON, *exc.headers]
        if exc.close:
            headers.append((b"connection", b"close"))
        return exc.status, headers, _encode({"error": exc.message, "status": exc.status})

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def _handle(self, scope: dict[str, Any], receive: Receive, path: str) -> tuple[int, bytes, bytes]:
        methods = _ROUTES.get(path)
        if methods is None:
            raise HttpError(404, f"no such path {path!r}: {_ROUTE_LIST}")
        method = scope["method"]
        if method not in methods:
            allow = ", ".join(methods)
            raise HttpError(
                405, f"{method} is not allowed on {path}: use {allow}", headers=[(b"allow", allow.encode())]
            )
        if method == "POST":
            raw = await self._read_body(scope, receive)
            if path == "/match":
                return 200, self._match_tokens(raw), b"application/json"
            return 200, self._match_hashes(raw), b"application/json"
        if path == "/healthz":
            return (
                200,
                _encode(
                    {"status": "ok", "pid": os.getpid(), "uptime_s": round(time.time() - self.started, 1)}
                ),
                b"application/json",
            )
        if path == "/readyz":
            return self._readyz()
        if path == "/workers":
            return 200, self._workers(), b"application/json"
        return 200, self._metrics().encode(), b"text/plain; version=0.0.4; charset=utf-8"

    # ------------------------------------------------------------------ bodies

    async def _read_body(self, scope: dict[str, Any], receive: Receive) -> bytes:
        """The body, within ``max_body_bytes`` (checked on Content-Length before reading, and
        counted while reading a chunked one)."""
        limit = self.options.max_body_bytes
        length: bytes | None = None
        chunked = False
        for name, value in scope["headers"]:
            if name == b"content-length":
                if length is not None and value != length:
                    raise HttpError(400, "conflicting Content-Length headers", close=True)
                length = value
            elif name == b"transfer-encoding":
                chunked = b"chunked" in value.lower()
        if length is not None:
            if not length.strip().isdigit():
                raise HttpError(400, f"bad Content-Length {length.decode('latin-1')!r}", close=True)
            if int(length) > limit:
                raise HttpError(
                    413, f"body of {int(length)} bytes is larger than the limit of {limit} bytes", close=True
                )
        elif not chunked:
            raise HttpError(
                411, "a Content-Length header (or chunked transfer encoding) is required", close=True
            )
        message = await receive()  # the body's deadline is the protocol's (_route_http)
        chunk: bytes = message.get("body", b"")
        if not message.get("more_body", False) and message["type"] != "http.disconnect":
            if len(chunk) > limit:
                raise HttpError(413, f"body larger than the limit of {limit} bytes", close=True)
            return chunk  # the whole body at once: the usual case
        parts: list[bytes] = []
        size = 0
        while True:
            if message["type"] == "http.disconnect":
                raise HttpError(400, "the client went away before sending the whole body", close=True)
            size += len(chunk)
            if size > limit:
                raise HttpError(413, f"body larger than the limit of {limit} bytes", close=True)
            parts.append(chunk)
            if not message.get("more_body", False):
                return b"".join(parts)
            message = await receive()
            chunk = message.get("body", b"")

    # ------------------------------------------------------------------ matching

    def _exclusions_now(self) -> tuple[dict[Any, str], frozenset[Any]]:
        """Stale/closed and degraded workers, refreshed at most every 0.2 s (under the lock)."""
        at, left_out, degraded = self._exclusions
        now = time.monotonic()
        if now - at >= _EXCLUSIONS_TTL_S or self._fast.index is not self.source.index:
            left_out = self.source.not_routable()
            degraded = frozenset(self.source.index.degraded_workers())
            self._exclusions = (now, left_out, degraded)
            if self._fast.index is not self.source.index:
                self._fast = FastAnswers(self.source.index, self.options.block_size)
            self._fast.refresh(left_out, degraded)
        return left_out, degraded

    def _matched(self, hashes: Sequence[int], by_content: bool, window: int | None, weight: float) -> bytes:
        """One prompt's answer, under the index's lock. A batch takes the lock once per prompt,
        so ingest (and other requests) run between its prompts: a batch of 256 prompts against
        4,000 workers renders 115 MB, 0.4 s that used to hold the lock whole."""
        with self.source.lock:
            self._exclusions_now()
            return self._fast.match(hashes, by_content, window, weight)

    def _match_tokens(self, raw: bytes) -> bytes:
        plain = self._fast.plain(raw)
        if plain is not None:
            prompts, window, batch = plain
            return _results([self._matched(h, True, window, 1.0) for h in prompts], batch)
        fast = self._fast.decode(raw)
        queries = None if fast is None else self._fast.hashes_of(fast)
        if fast is not None and queries is not None:
            weight = fast.secondary_weight
            parts = [self._matched(h, True, fast.window_size, weight) for h in queries]
            return _results(parts, fast.prompts is not None)
        return self._match_tokens_general(raw)

    def _match_tokens_general(self, raw: bytes) -> bytes:
        """Every body the fast path leaves: unusual forms, and errors with msgspec's messages."""
        try:
            body = msgspec.json.decode(raw, type=MatchBody)
        except msgspec.DecodeError as exc:
            raise HttpError(400, f"bad /match body: {exc}") from None
        except RecursionError:
            raise HttpError(400, "bad /match body: JSON nested too deeply") from None
        if (body.token_ids is None) == (body.prompts is None):
            raise HttpError(
                400,
                'give "token_ids" (one prompt) or "prompts" (a batch of {"token_ids", "lora_id"}), not both',
            )
        block_size = body.block_size or self.options.block_size
        prompts = [(body.token_ids, body.lora_id)] if body.token_ids is not None else [
            (p.token_ids, p.lora_id if p.lora_id is not None else body.lora_id) for p in body.prompts or ()
        ]  # fmt: skip
        for i, (tokens, lora) in enumerate(prompts):
            where = "" if body.token_ids is not None else f"prompts[{i}]."
            if tokens and max(tokens) > HASH_MAX:  # msgspec's JSON ints are not bounded
                raise HttpError(
                    400, f"bad /match body: {where}token_ids holds {max(tokens)}, more than 64 bits"
                )
            if lora is not None and lora > HASH_MAX:
                raise HttpError(400, f"bad /match body: {where}lora_id {lora} is more than 64 bits")
        answers = []
        for tokens, lora in prompts:  # the lock once per prompt, as _matched takes it
            with self.source.lock:
                left_out, degraded = self._exclusions_now()
                index = self.source.index
                answers.append(
                    score_query(index, index.content_hashes(tokens, block_size, lora), by_content=True,
                                secondary_weight=body.secondary_weight, window_size=body.window_size,
                                left_out=left_out, degraded=degraded)
                )  # fmt: skip
        return _encode(answers[0] if body.token_ids is not None else {"results": answers})

    def _match_hashes(self, raw: bytes) -> bytes:
        try:
            body = msgspec.json.decode(raw, type=HashesBody)
        except msgspec.DecodeError as exc:
            raise HttpError(400, f"bad /match/hashes body: {exc}") from None
        except RecursionError:
            raise HttpError(400, "bad /match/hashes body: JSON nested too deeply") from None
        if (body.block_hashes is None) == (body.prompts is None):
            raise HttpError(
                400,
                f'give "block_hashes" (one prompt) or "prompts" (up to {MAX_BATCH} of {{"block_hashes"}}), not both',
            )
        queries = (
            [body.block_hashes]
            if body.block_hashes is not None
            else [p.block_hashes for p in body.prompts or ()]
        )
        for i, hashes in enumerate(queries):
            if hashes and max(hashes) > HASH_MAX:
                where = "block_hashes" if body.block_hashes is not None else f"prompts[{i}].block_hashes"
                raise HttpError(
                    400, f"bad /match/hashes body: {where} holds {max(hashes)}, more than 64 bits"
                )
        parts = [self._matched(hashes, False, body.window_size, body.secondary_weight) for hashes in queries]
        return _results(parts, body.block_hashes is None)

    # ------------------------------------------------------------------ state

    def _readyz(self) -> tuple[int, bytes, bytes]:
        health = self.source.health()
        if health is None:
            return 200, _encode({"ready": True}), b"application/json"
        return (200 if health.ready else 503), _encode(health), b"application/json"

    def _workers(self) -> bytes:
        from kvevents.commands._workers_view import index_summary, worker_rows

        liveness = self.source.liveness
        now = time.time() if liveness is None else liveness.now()
        with self.source.lock:
            keys = self.source.index.workers()
            summary = index_summary(self.source.index, self.source.metrics())
        rows: list[dict[str, Any]] = []
        for start in range(0, len(keys), _ROWS_PER_HOLD):  # ingest and matches run in between
            with self.source.lock:
                chunk = worker_rows(self.source.index, keys[start : start + _ROWS_PER_HOLD])
                for row in chunk:
                    if liveness is None:
                        row.update(state="live", last_heard_s=None)
                    else:
                        info = liveness.instance(row["instance_id"], now)
                        row.update(state=info.state, last_heard_s=round(info.last_heard_s, 3),
                                   seconds_since_heard=round(now - info.last_heard_s, 3))  # fmt: skip
            rows.extend(chunk)
        for state in ("live", "stale", "closed"):
            summary[f"{state}_workers"] = sum(1 for r in rows if r["state"] == state)
        if liveness is not None:
            summary["stale_after_s"] = liveness.stale_after_s
        return _encode({"workers": rows, "summary": summary})

    def _metrics(self) -> str:
        from kvevents.consumer.liveness import not_routable_workers

        liveness = self.source.liveness
        now = time.time() if liveness is None else liveness.now()
        with self.source.lock:
            index = self.source.index
            left_out = {} if liveness is None else not_routable_workers(index, liveness, now)
            states = Counter(left_out.values())
            states["live"] = index.worker_count() - len(left_out)
            return render(self.requests, self.source.index, process=self.options.process,
                          health=self.source.health(), reader=self.source.metrics(), states=states,
                          gc_pauses=self.gc_pauses)  # fmt: skip
