"""The socket thread's inbox: bounded, in order, and a sleeping worker wakes for every message."""

from __future__ import annotations

import queue
import threading
import time

import pytest
from kvevents.producer.bridge.receiver import Inbox


def item(seq: int) -> tuple[int, int, bytes, float]:
    return (0, seq, b"", 0.0)


def test_bounded_and_in_order() -> None:
    inbox = Inbox(3)
    for seq in range(3):
        inbox.put_nowait(item(seq))
    with pytest.raises(queue.Full):
        inbox.put_nowait(item(3))
    assert inbox.qsize() == 3
    assert [inbox.get(0)[1] for _ in range(3)] == [0, 1, 2]
    started = time.monotonic()
    with pytest.raises(queue.Empty):
        inbox.get(0.05)
    assert time.monotonic() - started >= 0.04
    with pytest.raises(ValueError, match="maxsize"):
        Inbox(0)


def test_a_waiting_worker_gets_every_message_of_another_thread() -> None:
    inbox = Inbox(1000)
    got: list[int] = []

    def worker() -> None:
        while len(got) < 20_000:
            try:
                got.append(inbox.get(5.0)[1])
            except queue.Empty:
                return

    thread = threading.Thread(target=worker)
    thread.start()
    sent = 0
    while sent < 20_000:
        try:
            inbox.put_nowait(item(sent))
        except queue.Full:
            time.sleep(0)
            continue
        sent += 1
        if sent % 1000 == 0:
            time.sleep(0.001)  # let the worker find the inbox empty and sleep now and then
    thread.join(10)
    assert got == list(range(20_000))
