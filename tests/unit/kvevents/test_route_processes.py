"""``route --serve --workers N``'s listening sockets over real loopback sockets and forked server
processes: one ``SO_REUSEPORT`` socket per process spreads a burst of new connections over every
process (one shared socket let the first awake process take them all), and a port another
server listens on is refused, ``SO_REUSEPORT`` or not."""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import socket
import time
from collections import Counter
from collections.abc import Iterator

import pytest
from kvevents.consumer import CacheIndex

from kvevents.commands._route_http import ServeOptions, bind, listen, serve_static


def _serve(port_queue: multiprocessing.Queue, options: ServeOptions) -> None:  # type: ignore[type-arg]
    socks = listen("127.0.0.1", 0, options)
    port_queue.put((socks[0].getsockname()[1], len(socks)))
    serve_static(CacheIndex(), socks, options)


def _pid_of(conn: socket.socket) -> int:
    conn.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
    data = b""
    while b"\r\n\r\n" not in data or not data.endswith(b"}"):
        chunk = conn.recv(4096)
        assert chunk, data
        data += chunk
    pid: int = json.loads(data.split(b"\r\n\r\n", 1)[1])["pid"]
    return pid


@pytest.fixture(params=[True, False], ids=["reuse-port", "shared"])
def server(request: pytest.FixtureRequest) -> Iterator[tuple[int, int, bool]]:
    ctx = multiprocessing.get_context("fork")
    ports = ctx.Queue()
    options = ServeOptions(workers=2, reuse_port=request.param, header_timeout_s=30, keep_alive_s=30)
    child = ctx.Process(target=_serve, args=(ports, options))
    child.start()
    try:
        port, count = ports.get(timeout=30)
        deadline = time.monotonic() + 20
        while True:  # both processes listening: every connection of a burst is answered
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=5) as c:
                    _pid_of(c)
                break
            except OSError:
                assert time.monotonic() < deadline
                time.sleep(0.1)
        time.sleep(0.5)
        yield port, count, request.param
    finally:
        assert child.pid is not None
        os.kill(child.pid, signal.SIGTERM)
        child.join(15)
        assert child.exitcode == 0


def test_a_burst_of_connections_reaches_every_process(server: tuple[int, int, bool]) -> None:
    port, count, reuse_port = server
    assert count == (2 if reuse_port else 1)
    conns = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(32)]
    try:
        pids = Counter(_pid_of(c) for c in conns)
        again = Counter(_pid_of(c) for c in conns)  # keep-alive: each stays with its process
    finally:
        for c in conns:
            c.close()
    assert again == pids
    assert sum(pids.values()) == 32
    if reuse_port:  # hashed over 2 sockets: fewer than 4 of 32 on one has odds ~1e-6
        assert len(pids) == 2 and min(pids.values()) >= 4, pids


def test_a_port_another_server_listens_on_is_refused_even_with_so_reuseport() -> None:
    other = bind("127.0.0.1", 0, reuse_port=True)  # e.g. a router already serving on the port
    try:
        port = other.getsockname()[1]
        with pytest.raises(OSError):
            listen("127.0.0.1", port, ServeOptions(workers=2))
        with pytest.raises(OSError):
            listen("127.0.0.1", port, ServeOptions(workers=1))
    finally:
        other.close()
    socks = listen("127.0.0.1", port, ServeOptions(workers=3))  # free again: one socket each
    try:
        assert len(socks) == 3 and {s.getsockname()[1] for s in socks} == {port}
        assert all(s.getsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT) for s in socks)
    finally:
        for s in socks:
            s.close()


def _metrics_of(conn: socket.socket) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    from prometheus_client.parser import text_string_to_metric_families

    conn.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
    data = b""
    while b"\r\n\r\n" not in data:
        data += conn.recv(65536)
    head, _, body = data.partition(b"\r\n\r\n")
    length = int(
        next(h for h in head.split(b"\r\n") if h.lower().startswith(b"content-length:")).split(b":")[1]
    )
    while len(body) < length:
        body += conn.recv(65536)
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in text_string_to_metric_families(body.decode())
        for s in f.samples
    }


def test_every_process_settles_its_heap_and_times_its_collections(server: tuple[int, int, bool]) -> None:
    port, _count, _reuse_port = server
    conns = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(16)]
    try:
        by_pid = {_pid_of(c): c for c in conns}
        assert by_pid
        for conn in by_pid.values():
            samples = _metrics_of(conn)
            frozen = [v for (name, _), v in samples.items() if name == "kvevents_router_gc_frozen_objects"]
            assert len(frozen) == 1 and frozen[0] > 1_000  # the modules and index loaded before serving
            generations = {
                dict(labels)["generation"]
                for (name, labels) in samples
                if name == "kvevents_router_gc_collections_total"
            }
            assert generations == {"0", "1", "2"}
    finally:
        for c in conns:
            c.close()
