"""A measurement-only prototype: ``RouteApp``'s handlers under granian's RSGI interface (Rust
HTTP), to compare the server stacks in ``bench/route_serve.py`` (``--servers granian-2w``).
Not a server to deploy: no body-size check before reading, no JSON for HTTP-level errors, no
connection bound (what ``_route_http`` adds to uvicorn and the tests check). Each granian
worker process loads the index from the file named by ``KVEVENTS_BENCH_INDEX``."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from kvevents.consumer import CacheIndex

from kvevents.commands._route_app import AppOptions, HttpError, RouteApp, StaticSource

_JSON = [("content-type", "application/json")]


class RsgiRoute:
    """``POST /match``, ``POST /match/hashes`` and ``GET /healthz`` over RSGI."""

    def __init__(self) -> None:
        self._app: RouteApp | None = None

    def _route(self) -> RouteApp:
        if self._app is None:
            index = CacheIndex.from_bytes(Path(os.environ["KVEVENTS_BENCH_INDEX"]).read_bytes())
            block_size = int(os.environ.get("KVEVENTS_BENCH_BLOCK_SIZE", "32"))
            self._app = RouteApp(StaticSource(index), AppOptions(block_size=block_size))
        return self._app

    async def __rsgi__(self, scope: Any, protocol: Any) -> None:
        app = self._route()
        try:
            if scope.method == "POST" and scope.path == "/match":
                body = app._match_tokens(await protocol())
            elif scope.method == "POST" and scope.path == "/match/hashes":
                body = app._match_hashes(await protocol())
            elif scope.path == "/healthz":
                body = b'{"status":"ok"}'
            else:
                raise HttpError(404, f"no such path {scope.path!r}")
        except HttpError as exc:
            protocol.response_bytes(exc.status, _JSON, b'{"error":"%s"}' % exc.message.encode())
            return
        protocol.response_bytes(200, _JSON, body)


app = RsgiRoute()
