"""Background JVMs of this package (the local Kafka broker, the local registry): started in a
session of their own, optionally dying with the process that started them; and whether a pid
still lives."""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import IO

_PR_SET_PDEATHSIG = 1
_libc: ctypes.CDLL | None = None


def _die_with_parent() -> None:  # runs in the child between fork and exec
    if _libc is not None:
        _libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def spawn(
    command: Sequence[str], out: IO[bytes], cwd: Path, *, die_with_parent: bool
) -> subprocess.Popen[bytes]:
    """Start ``command`` in a new session, stdout and stderr to ``out``; with ``die_with_parent``
    the kernel sends it SIGTERM when this process ends (Linux ``PR_SET_PDEATHSIG``)."""
    global _libc
    if die_with_parent and _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
    return subprocess.Popen(
        command,
        stdin=subprocess.DEVNULL,
        stdout=out,
        stderr=subprocess.STDOUT,
        cwd=cwd,
        start_new_session=True,
        preexec_fn=_die_with_parent if die_with_parent else None,
    )


def pid_alive(pid: int) -> bool:
    """Whether ``pid`` is a live process. A zombie counts as gone once every thread of it has
    ended: a SIGKILLed JVM's main thread is a zombie some milliseconds before its other threads
    have exited and closed its sockets (a restart meanwhile found its ports taken)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
    if _state(stat) not in ("Z", "X"):
        return True
    return _some_thread_runs(pid)


def _state(stat: str) -> str:
    """The state letter of a ``/proc/.../stat`` line (after the command, which may hold spaces)."""
    return stat.rpartition(")")[2].split()[0]


def _some_thread_runs(pid: int) -> bool:
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return False
    for tid in tids:
        try:
            if _state(Path(f"/proc/{pid}/task/{tid}/stat").read_text()) not in ("Z", "X"):
                return True
        except OSError:
            continue
    return False
