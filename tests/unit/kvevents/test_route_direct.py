"""``route --serve``'s direct path over real loopback sockets: ``POST /match`` and
``/match/hashes`` with a plain Content-Length answered from the parser's callback (no ASGI task)
give the same bytes as the ASGI path, in order with pipelined requests, for bodies in pieces and
past uvicorn's read high-water mark; anything else (chunked, Expect, a length over the limit)
still takes the ASGI path with its answers."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from typing import Any

import pytest
from kvevents.consumer import CacheIndex
from test_route_http import (
    BS,
    PROMPT,
    LivenessSource,
    ResponseReader,
    read_response,
    run_in_thread,
    store_prefix,
)

from kvevents.commands._route_app import AppOptions, IndexSource, RouteApp
from kvevents.commands._route_http import ServeOptions, bind, make_server


class CountingApp(RouteApp):
    """Counts the requests that reached the ASGI entry point."""

    asgi_calls = 0

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            CountingApp.asgi_calls += 1
        await super().__call__(scope, receive, send)


def _start(direct: bool, max_body: int = 64 * 1024) -> Iterator[tuple[int, RouteApp]]:
    index = CacheIndex()
    for name, blocks in (("a", 2), ("b", 4), ("stale", 4)):
        store_prefix(index, name, PROMPT, blocks)
    sock = bind("127.0.0.1", 0)
    apps: list[RouteApp] = []

    def factory(source: IndexSource, options: AppOptions) -> RouteApp:
        apps.append(CountingApp(source, options))
        return apps[-1]

    options = ServeOptions(
        block_size=BS, max_body_bytes=max_body, header_timeout_s=2, body_timeout_s=2, direct=direct
    )
    server = make_server(sock, LivenessSource(index), options, app_factory=factory)
    with run_in_thread(server, sock) as port:
        yield port, apps[0]


@pytest.fixture
def both() -> Iterator[tuple[int, int]]:
    """Ports of a server with the direct path and one without."""
    for direct_port, _ in _start(True):
        for asgi_port, _ in _start(False):
            yield direct_port, asgi_port


def _exchange(port: int, data: bytes, answers: int = 1) -> list[tuple[int, dict[str, str], bytes]]:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(data)
        reader = ResponseReader(s)
        return [reader.read() for _ in range(answers)]


def _post(path: str, body: bytes, extra: bytes = b"") -> bytes:
    return b"POST %s HTTP/1.1\r\nHost: x\r\n%sContent-Length: %d\r\n\r\n%s" % (
        path.encode(),
        extra,
        len(body),
        body,
    )


CASES = [
    _post("/match", json.dumps({"token_ids": PROMPT}).encode()),
    _post("/match", json.dumps({"prompts": [{"token_ids": PROMPT}, {"token_ids": PROMPT[:8]}]}).encode()),
    _post("/match", json.dumps({"token_ids": PROMPT, "secondary_weight": 0.5}).encode()),
    _post("/match/hashes", json.dumps({"block_hashes": [1, 2, 3]}).encode()),
    _post("/match", b'{"token_ids": "nope"}'),  # 400 naming the field
    _post("/match", b"not json"),
    _post("/match/hashes", json.dumps({"block_hashes": [1 << 65]}).encode()),
    _post("/match", json.dumps({"token_ids": PROMPT}).encode(), b"Connection: close\r\n"),
    _post("/match", b""),  # Content-Length: 0: no body callback at all
    _post("/match/hashes", json.dumps({"prompts": [{"block_hashes": [1]}, {"block_hashes": []}]}).encode()),
]


@pytest.mark.parametrize("data", CASES, ids=range(len(CASES)))
def test_direct_answers_equal_the_asgi_path(both: tuple[int, int], data: bytes) -> None:
    direct, asgi = (_exchange(port, data)[0] for port in both)
    drop = {"date"}
    assert direct[0] == asgi[0]
    assert {k: v for k, v in direct[1].items() if k not in drop} == {
        k: v for k, v in asgi[1].items() if k not in drop
    }
    assert direct[2] == asgi[2]


def test_the_direct_path_skips_the_asgi_app_and_the_rest_takes_it() -> None:
    for port, app in _start(True):
        body = json.dumps({"token_ids": PROMPT}).encode()
        CountingApp.asgi_calls = 0
        status, _, answer = _exchange(port, _post("/match", body))[0]
        assert status == 200 and json.loads(answer)["best"]["instance_id"] == "b"
        assert CountingApp.asgi_calls == 0
        assert app.requests.counts[("/match", 200)] == 1  # counted in /metrics all the same
        chunked = (
            b"POST /match HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n%x\r\n%s\r\n0\r\n\r\n"
            % (
                len(body),
                body,
            )
        )
        status, _, answer = _exchange(port, chunked)[0]
        assert status == 200 and json.loads(answer)["best"]["instance_id"] == "b"
        assert CountingApp.asgi_calls == 1
        status, _, answer = _exchange(port, _post("/match", b"x" * (70 * 1024)))[0]  # over the limit: 413
        assert status == 413 and CountingApp.asgi_calls == 2
        status, _, _ = _exchange(port, _post("/match", body, b"Expect: 100-continue\r\n"), answers=1)[0]
        assert status in (100, 200) and CountingApp.asgi_calls == 3


def test_pipelined_direct_and_asgi_requests_are_answered_in_order() -> None:
    for port, _app in _start(True):
        one = _post("/match", json.dumps({"token_ids": PROMPT}).encode())
        other = _post("/match", json.dumps({"token_ids": PROMPT[:8]}).encode())
        data = one + b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n" + other + one + _post("/match", b"{}")
        answers = _exchange(port, data, answers=5)
        assert [a[0] for a in answers] == [200, 200, 200, 200, 400]
        assert json.loads(answers[0][2])["best"]["matched_blocks"] == 4
        assert json.loads(answers[1][2])["status"] == "ok"
        assert json.loads(answers[2][2])["best"]["matched_blocks"] == 2
        assert answers[3][2] == answers[0][2]


def test_a_body_in_pieces_and_one_past_the_read_high_water_mark_are_answered() -> None:
    for port, _app in _start(True, max_body=1 << 20):
        tokens = PROMPT + list(range(1, 40_000))  # ~240 KB of JSON: reading would pause at 64 KiB
        data = _post("/match", json.dumps({"token_ids": tokens}).encode())
        assert len(data) > 200_000
        with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
            for start in range(0, len(data), 50_000):
                s.sendall(data[start : start + 50_000])
                time.sleep(0.05)
            status, _, body = read_response(s)
            assert status == 200 and json.loads(body)["best"]["instance_id"] == "b"
            s.sendall(_post("/match", json.dumps({"token_ids": PROMPT}).encode()))  # the connection goes on
            assert read_response(s)[0] == 200


def test_http_1_0_and_connection_close_end_the_connection_after_the_answer() -> None:
    for port, _app in _start(True):
        body = json.dumps({"token_ids": PROMPT}).encode()
        for data in (
            b"POST /match HTTP/1.0\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body),
            _post("/match", body, b"Connection: close\r\n"),
        ):
            with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
                s.sendall(data)
                status, headers, _ = read_response(s)
                assert status == 200 and headers.get("connection") == "close"
                assert s.recv(10) == b""  # closed by the server
