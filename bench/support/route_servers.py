"""The servers ``bench/route_serve.py`` compares, each started in a child process that puts its
port on a queue: the old stdlib server, the old handlers on uvicorn, the product's uvicorn stack
(direct path or ASGI, per-process or shared socket, static index or a live follower), and the
granian prototype."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

from kvevents.consumer import CacheIndex
from support import route_index


def _serve_stdlib(index: CacheIndex, port_queue: Any) -> None:
    from support.stdlib_route_server import MatchServer

    server = MatchServer(("127.0.0.1", 0), index, threading.Lock(), None, route_index.BLOCK_SIZE)
    server.handle_error = lambda request, address: None  # type: ignore[method-assign]  # wrk's resets
    port_queue.put(server.server_address[1])
    signal.signal(signal.SIGTERM, lambda *_: threading.Thread(target=server.shutdown).start())
    server.serve_forever(poll_interval=0.1)
    server.server_close()


def _serve_uvicorn(
    index: CacheIndex,
    port_queue: Any,
    workers: int,
    old: bool = False,
    shared: bool = False,
    direct: bool = True,
) -> None:
    from support.route_old_app import OldRouteApp

    from kvevents.commands._route_app import RouteApp
    from kvevents.commands._route_http import ServeOptions, listen, serve_static

    options = ServeOptions(
        workers=workers,
        block_size=route_index.BLOCK_SIZE,
        access_log=False,
        reuse_port=not shared,
        direct=direct,
    )
    socks = listen("127.0.0.1", 0, options)
    port_queue.put(socks[0].getsockname()[1])
    serve_static(index, socks, options, OldRouteApp if old else RouteApp)


def _serve_live(index: CacheIndex, port_queue: Any, workers: int) -> None:
    """uvicorn-2w with each process a ``LiveIndex`` following an idle topic of the broker in
    ``KAFKA_BOOTSTRAP_SERVERS`` (as ``route --serve`` does): what the follower thread costs."""
    from confluent_kafka.admin import AdminClient
    from kvevents.consumer import LiveIndex
    from kvevents.consumer.topics import TopicSpec, create_topic

    from kvevents.commands._route_http import ServeOptions, listen, serve

    bootstrap = os.environ.get("KAFKA_BOOTSTRAP_SERVERS")
    if not bootstrap:
        raise SystemExit("uvicorn-2w-live needs KAFKA_BOOTSTRAP_SERVERS (a broker to follow)")
    topic = f"bench-route-live-{os.getpid()}-{int(time.time())}"
    create_topic(bootstrap, TopicSpec(topic))
    options = ServeOptions(workers=workers, block_size=route_index.BLOCK_SIZE)
    socks = listen("127.0.0.1", 0, options)
    port_queue.put(socks[0].getsockname()[1])

    def follow(process: int) -> LiveIndex:
        live = LiveIndex(bootstrap, topic, index=index, offsets={0: 0})
        live.start()
        return live

    try:
        serve(socks, follow, options, on_exit=lambda process, source, signalled: source.close())  # type: ignore[attr-defined]
    finally:
        admin = AdminClient({"bootstrap.servers": bootstrap})  # kept: its futures need it alive
        admin.delete_topics([topic])[topic].result(30)


def _serve_granian(index: CacheIndex, port_queue: Any, workers: int) -> None:
    import socket
    import tempfile

    from granian import Granian  # a measurement-only prototype (see support/route_granian.py)

    with tempfile.NamedTemporaryFile(suffix=".index", delete=False) as f:
        f.write(index.to_bytes())
    os.environ["KVEVENTS_BENCH_INDEX"] = f.name
    os.environ["KVEVENTS_BENCH_BLOCK_SIZE"] = str(route_index.BLOCK_SIZE)
    with socket.socket() as probe:  # a free port (granian binds by number)
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    port_queue.put(port)
    server = Granian("support.route_granian:app", address="127.0.0.1", port=port, interface="rsgi",
                     workers=workers, log_enabled=False, backlog=2048,
                     working_dir=Path(__file__).resolve().parents[1])  # fmt: skip
    try:
        server.serve()
    finally:
        os.unlink(f.name)


SERVERS = {
    "stdlib": (_serve_stdlib, {}),
    "old-2w": (_serve_uvicorn, {"workers": 2, "old": True}),
    "uvicorn-1w": (_serve_uvicorn, {"workers": 1}),
    "uvicorn-2w": (_serve_uvicorn, {"workers": 2}),
    "uvicorn-2w-shared": (_serve_uvicorn, {"workers": 2, "shared": True}),
    "uvicorn-2w-asgi": (_serve_uvicorn, {"workers": 2, "direct": False}),
    "uvicorn-2w-live": (_serve_live, {"workers": 2}),
    "granian-2w": (_serve_granian, {"workers": 2}),
}
