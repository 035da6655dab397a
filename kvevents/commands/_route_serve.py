"""``route --serve``: the index built by ``route`` (caught up with the topic) served over HTTP by
``--workers`` processes, each a :class:`~kvevents.consumer.LiveIndex` replica that resumes from
the shared index, its offsets and liveness and keeps following the topic; on SIGTERM/SIGINT the servers
drain, and process 0 saves the checkpoint."""

from __future__ import annotations

import argparse
import logging
import sys
from typing import TYPE_CHECKING, Any

from kvevents.commands._common import CommandError, kafka_config
from kvevents.commands._index_build import save_checkpoint_to

if TYPE_CHECKING:
    from kvevents.commands._index_build import Built

__all__ = ["serve_live"]

log = logging.getLogger(__name__)


def serve_live(args: argparse.Namespace, built: Built) -> int:
    """Serve until SIGTERM/SIGINT; 0 after a graceful stop with the checkpoint saved."""
    try:
        from kvevents.commands._route_http import ServeOptions, listen, serve
    except ImportError as exc:
        built.close()
        raise CommandError(f"route --serve needs uvicorn: pip install 'kvevents[serve]' ({exc})") from exc
    from kvevents.consumer import LiveIndex, ReaderError

    offsets = built.reader.offsets()
    bootstrap = built.bootstrap
    built.close()  # each server process opens its own reader (librdkafka does not survive fork)
    options = ServeOptions(
        workers=args.workers,
        block_size=args.block_size,
        max_body_bytes=args.max_body_bytes,
        max_connections=args.max_connections,
        header_timeout_s=args.header_timeout,
        body_timeout_s=args.body_timeout,
        keep_alive_s=args.keep_alive,
        reuse_port=not args.shared_socket,
    )
    try:
        socks = listen(args.host, args.port, options)
    except OSError as exc:
        raise CommandError(f"cannot listen on {args.host}:{args.port}: {exc.strerror or exc}") from exc
    host, port = socks[0].getsockname()[:2]
    print(
        f"serving on http://{host}:{port} with {args.workers} process(es) (POST /match, POST /match/hashes, "
        f"GET /workers /healthz /readyz /metrics); {len(built.index.workers())} worker(s); SIGTERM or Ctrl-C stops",
        flush=True,
    )
    failures: list[str] = []

    def make_source(process: int) -> LiveIndex:
        live = LiveIndex(
            bootstrap,
            args.topic,
            index=built.index,
            offsets=offsets,
            liveness=built.liveness.saved(),
            config=kafka_config(args),
            stale_after_s=args.stale_after,
            max_ready_lag=args.ready_max_lag,
        )
        try:
            live.start()
        except ReaderError as exc:
            raise CommandError(f"process {process}: cannot follow {args.topic!r}: {exc}") from exc
        return live

    def on_exit(process: int, source: Any, signalled: int | None) -> None:
        live: LiveIndex = source
        live.stop()
        try:
            if process == 0:
                for line in save_checkpoint_to(args, live.checkpoint(), bootstrap):
                    print(line, file=sys.stderr, flush=True)
        except CommandError as exc:
            failures.append(str(exc))
            print(f"kvevents route: {exc}", file=sys.stderr, flush=True)
        finally:
            metrics = live.metrics()
            events = 0 if metrics is None else metrics.events_total
            print(
                f"process {process}: stopped; {events:,} events read while serving"
                + (f"; follower error: {live.error}" if live.error else ""),
                file=sys.stderr,
                flush=True,
            )
            live.close()

    try:
        serve(socks, make_source, options, on_exit)
    finally:
        for sock in socks:
            sock.close()
    return 1 if failures else 0
