"""The socket thread: one SUB per data-parallel rank, receive only, into a bounded queue.

It never decodes and never waits on anything but the sockets: when the queue is full a message
is dropped and counted per rank (the seq gap it leaves is then filled by replay, or reported).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import Counter, deque
from typing import Any

__all__ = ["Inbox", "Received", "ZmqReceiver", "rank_endpoint"]

log = logging.getLogger(__name__)

Received = tuple[int, int, bytes, float]  # (rank, seq, payload, receive time.monotonic())


class Inbox:
    """The bounded FIFO from the socket thread to the worker, with ``queue.Queue``'s
    ``put_nowait`` (raises ``queue.Full``) and ``get(timeout)`` (raises ``queue.Empty``) but no
    lock per message: a deque's append and popleft are atomic, and the worker sleeps on an event
    only when it found nothing. (A contended queue lock hands the GIL back and forth between the
    two threads at every message.)"""

    def __init__(self, maxsize: int) -> None:
        if maxsize < 1:
            raise ValueError(f"maxsize must be >= 1, got {maxsize}")
        self.maxsize = maxsize
        self._items: deque[Received] = deque()
        self._ready = threading.Event()

    def qsize(self) -> int:
        return len(self._items)

    def put_nowait(self, item: Received) -> None:
        if len(self._items) >= self.maxsize:
            raise queue.Full
        self._items.append(item)
        if not self._ready.is_set():  # the worker may be asleep (it clears before it sleeps)
            self._ready.set()

    def get(self, timeout: float | None = None) -> Received:
        items = self._items
        while True:
            if items:
                return items.popleft()
            self._ready.clear()
            if items:  # appended between the check and the clear
                continue
            if not self._ready.wait(timeout):
                if items:
                    return items.popleft()
                raise queue.Empty


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

        self.queue = Inbox(max_queued)
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
