"""SIGTERM handled like Ctrl-C (``docker stop``, ``kill``, systemd): the command's SIGINT handler
runs, so a command that saves its checkpoint on Ctrl-C does so on SIGTERM too."""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType

__all__ = ["sigterm_as_sigint"]


@contextmanager
def sigterm_as_sigint() -> Iterator[None]:
    """Within the block, SIGTERM calls whatever handles SIGINT at that moment (main thread only)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: FrameType | None) -> None:
        current = signal.getsignal(signal.SIGINT)
        if callable(current):
            current(signal.SIGINT, frame)
        else:
            raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
