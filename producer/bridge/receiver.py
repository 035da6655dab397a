"""The socket thread: one SUB per data-parallel rank, receive only, into a bounded queue.

It never decodes and never waits on anything but the sockets: when the queue is full a message
is dropped and counted per rank (the seq gap it leaves is then filled by replay, or reported).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import Counter
from typing import Any

__all__ = ["Received", "ZmqReceiver", "rank_endpoint"]

log = logging.getLogger(__name__)

Received = tuple[int, int, bytes, float]  # (rank, seq, payload, receive time.monotonic())


def rank_endpoint(endpoint: str, rank: int) -> str:
    """The engines' rule: tcp port + rank; ipc/inproc paths get ``_dp<rank>``; rank 0 unchanged."""
    if rank == 0:
        return endpoint
    if endpoint.startswith("tcp://"):
        base, _, port = endpoint.rpartition(":")
        return f"{base}:{int(port) + rank}"
    return f"{endpoint}_dp{rank}"


class ZmqReceiver:
    """SUB sockets connected to ``endpoint`` (+ rank) for ranks ``0..dp_size-1``, topic prefix
    ``topic``; messages land in ``queue`` (at most ``max_queued``)."""

    def __init__(
        self,
        ctx: Any,
        endpoint: str,
        dp_size: int,
        *,
        topic: bytes = b"",
        max_queued: int = 100_000,
        rcvhwm: int = 100_000,
    ) -> None:
        import zmq

        self.queue: queue.Queue[Received] = queue.Queue(max_queued)
        self.dropped: Counter[int] = Counter()
        self.received: Counter[int] = Counter()
        self.malformed: Counter[int] = Counter()
        self.max_dropped_seq: dict[int, int] = {}  # per rank, the newest seq dropped (a tail gap)
        self._stop = threading.Event()
        self._sockets: dict[Any, int] = {}
        self._poller = zmq.Poller()
        for rank in range(dp_size):
            sock = ctx.socket(zmq.SUB)
            sock.setsockopt(zmq.RCVHWM, rcvhwm)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SUBSCRIBE, topic)
            sock.connect(rank_endpoint(endpoint, rank))
            self._sockets[sock] = rank
            self._poller.register(sock, zmq.POLLIN)
        self._zmq = zmq
        self._thread = threading.Thread(target=self._run, name="kvevents-bridge-recv", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        zmq = self._zmq
        put = self.queue.put_nowait
        try:
            while not self._stop.is_set():
                for sock, _ in self._poller.poll(100):
                    rank = self._sockets[sock]
                    while True:
                        try:
                            frames = sock.recv_multipart(zmq.NOBLOCK, copy=True)
                        except zmq.Again:
                            break
                        if len(frames) != 3 or len(frames[1]) != 8:
                            self.malformed[rank] += 1
                            continue
                        self.received[rank] += 1
                        seq = int.from_bytes(frames[1], "big")
                        try:
                            put((rank, seq, frames[2], time.monotonic()))
                        except queue.Full:
                            self.dropped[rank] += 1
                            self.max_dropped_seq[rank] = seq
        except zmq.ContextTerminated:
            pass
        except Exception:  # a socket error must be visible, not a silent stop
            log.exception("bridge receiver stopped")

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2)
        for sock in self._sockets:
            sock.close(0)
