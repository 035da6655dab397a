"""Asking an engine's replay ROUTER for missed batches, over a DEALER socket (a REQ socket would
read only the first reply). Request ``[b"", start_seq u64 BE]``; replies ``[b"", seq, payload]``
or ``[b"", topic, seq, payload]``, then the end marker seq ``2**64 - 1`` with an empty payload."""

from __future__ import annotations

import time
from typing import Any

__all__ = ["END_SEQ", "ReplayResult", "request_replay"]

END_SEQ = 0xFFFF_FFFF_FFFF_FFFF


class ReplayResult:
    """``batches``: ``(seq, payload)`` in the order received; ``complete``: the end marker came."""

    __slots__ = ("batches", "complete", "malformed")

    def __init__(self) -> None:
        self.batches: list[tuple[int, bytes]] = []
        self.complete = False
        self.malformed = 0


def request_replay(
    ctx: Any, endpoint: str, start_seq: int, *, timeout: float = 2.0, max_batches: int = 100_000
) -> ReplayResult:
    """The batches the engine still holds from ``start_seq`` on (a fresh DEALER per request, so a
    late answer to an earlier one can never be mistaken for this one)."""
    import zmq

    result = ReplayResult()
    if start_seq >= END_SEQ:  # no seq can follow: the last 8-byte value is the end marker
        result.complete = True
        return result
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(endpoint)
        sock.send_multipart([b"", start_seq.to_bytes(8, "big")])
        deadline = time.monotonic() + timeout
        while len(result.batches) <= max_batches:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not sock.poll(int(remaining * 1000) + 1):
                break
            frames = sock.recv_multipart()
            if frames and frames[0] == b"":
                frames = frames[1:]
            if len(frames) == 3:
                frames = frames[1:]  # [topic, seq, payload]
            if len(frames) != 2 or len(frames[0]) != 8:
                result.malformed += 1
                continue
            seq = int.from_bytes(frames[0], "big")
            if seq == END_SEQ:
                result.complete = True
                break
            result.batches.append((seq, frames[1]))
            deadline = time.monotonic() + timeout  # keep reading while replies flow
    finally:
        sock.close(0)
    return result
