"""Background JVMs of this package (the local Kafka broker, the local registry): started in a
session of their own, optionally dying with the process that started them; whether a pid
still lives, and what it runs."""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO

_PR_SET_PDEATHSIG = 1
_PF_KTHREAD = 0x00200000  # in the flags field of /proc/<pid>/stat
ARGV_SETTLE_SECONDS = 5.0
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


def process_argv(pid: int, settle: float = ARGV_SETTLE_SECONDS) -> list[str] | None:
    """The arguments of process ``pid``, None when ``/proc`` does not show them.

    A process shows none for a moment while it execs (``Popen`` returns when exec closes its
    pipe, before the kernel has copied the new arguments) and while it exits: wait up to
    ``settle`` seconds for them or for its end. [] for a kernel thread, a process that ended,
    or one that still shows none (so never taken for a process of ours).
    """
    deadline = time.monotonic() + settle
    while True:
        try:
            raw = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            return None
        argv = [part.decode(errors="replace") for part in raw.split(b"\0") if part]
        if argv or _kernel_thread(pid) or not pid_alive(pid) or time.monotonic() >= deadline:
            return argv
        time.sleep(0.01)


def _kernel_thread(pid: int) -> bool:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    except OSError:
        return False
    return len(fields) > 6 and int(fields[6]) & _PF_KTHREAD != 0
