"""Serving :class:`._route_app.RouteApp` with uvicorn (httptools parser, uvloop): a protocol that
adds what uvicorn lacks (deadlines for the request head and body, so a slow-loris, a slow body or
a silent connection is closed with a JSON 408; a bound on open connections answered with a JSON
503; JSON for the parser's 400; a response's head and body in one write), graceful shutdown on
SIGTERM/SIGINT, and N worker processes, each with its own listening socket on the port
(``SO_REUSEPORT``) and its own source (a :class:`~kvevents.consumer.LiveIndex` replica following
the topic). Why and what was measured: docs/ROUTER.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import sys
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
import uvicorn
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol, RequestResponseCycle

from kvevents.commands._route_app import AppOptions, IndexSource, RouteApp, StaticSource
from kvevents.commands._route_gc import GcPauses, settle

__all__ = ["GuardedProtocol", "ServeOptions", "bind", "listen", "make_server", "serve", "serve_static"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServeOptions:
    """Limits and sizes of the server (per process where it says so)."""

    workers: int = 1
    block_size: int = 32
    max_body_bytes: int = 4 * 1024 * 1024
    max_connections: int = 4096  # per process; the next one gets 503 and is closed
    header_timeout_s: float = 10.0  # from the first byte of a request (or the connection) to its last header
    body_timeout_s: float = 30.0
    keep_alive_s: float = 5.0  # an idle keep-alive connection is closed after this
    shutdown_timeout_s: float = 10.0
    backlog: int = 2048
    access_log: bool = False
    reuse_port: bool = True  # one listening socket per process (SO_REUSEPORT), else one shared
    direct: bool = True  # POST /match(/hashes) with a plain Content-Length answered without an ASGI task


def _json_error(status: int, reason: str, message: str) -> bytes:
    body = msgspec.json.encode({"error": message, "status": status})
    return (
        f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
        "connection: close\r\n\r\n"
    ).encode() + body


class _JoinedWrites:
    """A connection's transport as its responses see it: a response's head is held until its body,
    so both go out in one write (one segment and one wake-up of the client instead of two);
    :meth:`flush` when a response completes (a HEAD answer has no body write). Anything else
    passes on."""

    __slots__ = ("_held", "transport")

    def __init__(self, transport: asyncio.Transport) -> None:
        self.transport = transport
        self._held: bytes | None = None

    def write(self, data: bytes) -> None:
        if self._held is None and data.startswith(b"HTTP/1.1 ") and not data.startswith(b"HTTP/1.1 1"):
            self._held = data  # the head (not a 100 Continue)
            return
        if self._held:
            data, self._held = self._held + data, b""
        self.transport.write(data)

    def flush(self) -> None:
        """Write a head still held (a response without a body write: HEAD)."""
        if self._held:
            self.transport.write(self._held)
            self._held = b""

    def close(self) -> None:
        self.flush()
        self.transport.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.transport, name)


_DIRECT_PATHS = frozenset(("/match", "/match/hashes"))


class GuardedProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with deadlines for the request head and body, and a
    connection bound. A timer runs only while a request is partly read when a read ends (or a
    new connection is silent): a request that arrives whole in one read, the usual case, arms none.

    The direct path (``direct``): a ``POST /match`` or ``/match/hashes`` with one plain
    Content-Length within the limit (no chunked body, no ``Expect``) is answered when its body is
    complete, by :meth:`RouteApp.answer_post` called from the parser's callback, the answer
    written at once: no ASGI task, receive/send messages or header checks per request (the
    same bytes as the ASGI path; anything else takes that path, in order with pipelined requests)."""

    header_timeout_s = 10.0
    body_timeout_s = 30.0
    max_connections = 4096
    join_writes = True  # a response's head and body in one write (_JoinedWrites)
    direct = True

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._joined = _JoinedWrites(transport) if self.join_writes else None
        self._timer: asyncio.TimerHandle | None = None
        self._in_head = self._in_body = False
        app = self.app
        self._direct_app: RouteApp | None = app if self.direct and isinstance(app, RouteApp) else None
        self._direct_waiting: RequestResponseCycle | None = None  # started, its body still coming
        if len(self.connections) > self.max_connections:
            transport.write(
                _json_error(503, "Service Unavailable", f"more than {self.max_connections} open connections")
            )
            transport.close()
            return
        self._arm(self._head_timeout, self.header_timeout_s)

    def _arm(self, callback: Callable[[], None], delay: float) -> None:
        self._disarm()
        self._timer = self.loop.call_later(delay, callback)
        self._timer_callback = callback

    def _disarm(self) -> None:
        timer = getattr(self, "_timer", None)
        if timer is not None:
            timer.cancel()
            self._timer = None

    def _expire(self, message: str) -> None:
        self._timer = None
        if not self.transport.is_closing():
            self.transport.write(_json_error(408, "Request Timeout", message))
            self.transport.close()

    def _head_timeout(self) -> None:
        self._expire(f"the request head did not arrive within {self.header_timeout_s:g} s")

    def _body_timeout(self) -> None:
        self._expire(f"the body did not arrive within {self.body_timeout_s:g} s")

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self._in_head:  # the head's deadline runs from the read that began it
            if self._timer is None or self._timer_callback != self._head_timeout:
                self._arm(self._head_timeout, self.header_timeout_s)
        elif self._in_body:
            if self._timer is None or self._timer_callback != self._body_timeout:
                self._arm(self._body_timeout, self.body_timeout_s)
        else:  # nothing half-read: idle (uvicorn's keep-alive timeout) or answering
            self._disarm()

    def on_message_begin(self) -> None:
        self._in_head, self._in_body = True, False
        super().on_message_begin()

    def on_headers_complete(self) -> None:
        self._in_head, self._in_body = False, True
        super().on_headers_complete()
        if self._joined is not None and self.cycle is not None:
            self.cycle.transport = self._joined  # type: ignore[assignment]

    def on_message_complete(self) -> None:
        self._in_head = self._in_body = False
        super().on_message_complete()
        waiting = self._direct_waiting
        if waiting is not None and waiting is self.cycle:
            self._direct_waiting = None
            self._answer_direct(waiting)

    def on_body(self, body: bytes) -> None:
        super().on_body(body)
        if self._direct_waiting is not None and self._direct_waiting is self.cycle:
            self.flow.resume_reading()  # no receive() resumes it: the body is within the limit

    def _start_asgi_task(self, cycle: RequestResponseCycle, app: Any) -> None:
        if app is not self._direct_app or not self._direct_ok(cycle):
            super()._start_asgi_task(cycle, app)
        elif cycle.more_body:
            self._direct_waiting = cycle  # answered by on_message_complete
        else:  # a pipelined request, whole, started as the one before it completes: not nested
            self.loop.call_soon(self._answer_direct, cycle)

    def _direct_ok(self, cycle: RequestResponseCycle) -> bool:
        scope = cycle.scope
        if (
            scope["method"] != "POST"
            or scope["path"] not in _DIRECT_PATHS
            or cycle.waiting_for_100_continue
            or self.flow.write_paused
        ):
            return False
        length: bytes | None = None
        for name, value in scope["headers"]:
            if name == b"content-length":
                if length is not None:
                    return False
                length = value
            elif name == b"transfer-encoding":
                return False
        assert self._direct_app is not None
        return (
            length is not None and length.isdigit() and int(length) <= self._direct_app.options.max_body_bytes
        )

    def _answer_direct(self, cycle: RequestResponseCycle) -> None:
        """Answer a direct request whose body is complete, and complete its cycle as uvicorn's
        ``send`` does (the keep-alive timer, the next pipelined request)."""
        if cycle.disconnected or self.transport.is_closing():
            return
        assert self._direct_app is not None
        status, headers, body = self._direct_app.answer_post(cycle.scope["path"], bytes(cycle.body))
        content = [STATUS_LINE[status]]
        for name, value in (*cycle.default_headers, *headers):
            content += (name, b": ", value, b"\r\n")
            if name == b"connection" and value == b"close":
                cycle.keep_alive = False
        if not cycle.keep_alive and (b"connection", b"close") not in headers:
            content.append(b"connection: close\r\n")
        content += (b"\r\n", body)
        cycle.response_started = cycle.response_complete = True
        self.transport.write(b"".join(content))
        if not cycle.keep_alive:
            self.transport.close()
        cycle.on_response()

    def on_response_complete(self) -> None:
        if self._joined is not None:
            self._joined.flush()
        super().on_response_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def send_400_response(self, msg: str) -> None:
        self.transport.write(_json_error(400, "Bad Request", f"malformed HTTP request: {msg}"))
        self.transport.close()


class _Server(uvicorn.Server):
    """Handles SIGTERM/SIGINT as a graceful stop and does not re-raise them afterwards (the
    caller still has the checkpoint to write)."""

    signalled: int | None = None

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        if not _in_main_thread():
            yield
            return

        def handle(signum: int, frame: Any) -> None:
            self.signalled = signum
            if self.should_exit and signum == signal.SIGINT:
                self.force_exit = True
            self.should_exit = True

        previous = {sig: signal.signal(sig, handle) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


def _in_main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


def bind(host: str, port: int, backlog: int = 2048, *, reuse_port: bool = False) -> socket.socket:
    """A listening socket (``reuse_port``: with ``SO_REUSEPORT``, so more can share the port);
    OSError if it cannot be bound."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
        sock.listen(backlog)
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


def listen(host: str, port: int, options: ServeOptions) -> list[socket.socket]:
    """The listening sockets of ``options.workers`` processes, all on one port (``port`` 0: a
    free one): one per process with ``SO_REUSEPORT`` (``options.reuse_port``, the default, on
    Linux, whose kernel spreads connections over such sockets), else one shared by all. Bound
    here, before any fork, so a port in use fails at once, and a port another server listens on
    fails even if it set ``SO_REUSEPORT`` too (it would otherwise take a share of ours)."""
    if options.workers <= 1 or not options.reuse_port or not sys.platform.startswith("linux"):
        return [bind(host, port, options.backlog)]
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:  # in use by anyone, SO_REUSEPORT or not:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # fail, not share it
        probe.bind((host, port))
        port = probe.getsockname()[1]
    socks: list[socket.socket] = []
    try:
        socks += [bind(host, port, options.backlog, reuse_port=True) for _ in range(options.workers)]
    except OSError:
        for sock in socks:
            sock.close()
        raise
    return socks


AppFactory = Callable[[IndexSource, AppOptions], RouteApp]


def make_server(
    sock: socket.socket, source: IndexSource, options: ServeOptions, process: int = 0,
    app_factory: AppFactory = RouteApp, gc_pauses: GcPauses | None = None,
) -> uvicorn.Server:  # fmt: skip
    """The uvicorn server of one process (``server.run(sockets=[sock])`` serves until
    ``server.should_exit`` is set or, in the main thread, SIGTERM/SIGINT). ``app_factory``:
    another app (the benchmark's baseline); ``gc_pauses``: the process's GC timing, for /metrics."""
    protocol = type("Guarded", (GuardedProtocol,), {"header_timeout_s": options.header_timeout_s,
                                                     "body_timeout_s": options.body_timeout_s,
                                                     "max_connections": options.max_connections,
                                                     "direct": options.direct})  # fmt: skip
    app = app_factory(source, AppOptions(options.block_size, options.max_body_bytes, process))
    app.gc_pauses = gc_pauses
    config = uvicorn.Config(
        app,
        http=protocol,
        loop="uvloop",
        lifespan="on",
        interface="asgi3",
        timeout_keep_alive=max(1, round(options.keep_alive_s)),
        timeout_graceful_shutdown=max(1, round(options.shutdown_timeout_s)),
        backlog=options.backlog,
        access_log=options.access_log,
        log_level="warning",
        log_config=None,
        server_header=False,
        proxy_headers=False,
    )
    return _Server(config)


def _run_one(
    sock: socket.socket, source: IndexSource, options: ServeOptions, process: int, app_factory: AppFactory
) -> int | None:
    """Serve until SIGTERM/SIGINT in this process; the signal that stopped it, if any. The heap
    is settled first (:func:`._route_gc.settle`) and collections are timed while serving."""
    settle()
    pauses = GcPauses().install()
    try:
        server = make_server(sock, source, options, process, app_factory, pauses)
        server.run(sockets=[sock])
    finally:
        pauses.remove()
    return server.signalled if isinstance(server, _Server) else None


def serve(
    socks: socket.socket | Sequence[socket.socket],
    make_source: Callable[[int], IndexSource],
    options: ServeOptions,
    on_exit: Callable[[int, IndexSource, int | None], None] | None = None,
    app_factory: AppFactory = RouteApp,
) -> int | None:
    """Serve with ``options.workers`` processes: process i listens on ``socks[i]`` (:func:`listen`),
    or all on the one socket given. Each process calls ``make_source(i)`` (after the fork, so
    each follows the topic itself), serves, then ``on_exit(i, source, signal)``. With one worker
    everything runs in this process. Returns the stopping signal. With several, each process
    closes the sockets of the others and the parent closes them all once forked (a process that
    dies takes its socket with it: the kernel stops sending it connections)."""
    listening = [socks] if isinstance(socks, socket.socket) else list(socks)
    if options.workers <= 1:
        source = make_source(0)
        signalled = _run_one(listening[0], source, options, 0, app_factory)
        if on_exit is not None:
            on_exit(0, source, signalled)
        return signalled
    children: list[int] = []
    settle()  # the parent's objects frozen before the fork: the children's collections skip them
    for i in range(options.workers):
        pid = os.fork()
        if pid == 0:  # the worker process
            code = 0
            try:
                mine = listening[i % len(listening)]
                for other in listening:
                    if other is not mine:
                        other.close()
                source = make_source(i)
                signalled = _run_one(mine, source, options, i, app_factory)
                if on_exit is not None:
                    on_exit(i, source, signalled)
            except BaseException:
                log.exception("worker process %d failed", i)
                code = 1
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        children.append(pid)
    if len(listening) > 1:
        for sock in listening:
            sock.close()
    return _supervise(children)


def _supervise(children: list[int]) -> int | None:
    """Forward SIGTERM/SIGINT to the worker processes and wait for all of them."""
    stop: list[int] = []

    def forward(signum: int, frame: Any) -> None:
        stop.append(signum)
        for pid in children:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        left = set(children)
        while left:
            try:
                pid, status = os.wait()
            except ChildProcessError:
                break
            if pid in left:
                left.discard(pid)
                if not stop and os.waitstatus_to_exitcode(status) != 0:
                    log.error("worker process %d exited (%s); stopping the others", pid, status)
                    forward(signal.SIGTERM, None)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return stop[0] if stop else None


def serve_static(
    index: Any, socks: socket.socket | Sequence[socket.socket], options: ServeOptions,
    app_factory: AppFactory = RouteApp,
) -> None:  # fmt: skip
    """Serve a fixed index (benchmarks, tests): every process shares the parent's copy."""
    serve(socks, lambda i: StaticSource(index), options, app_factory=app_factory)
