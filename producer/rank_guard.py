"""Keep an MPI job going when one of its ranks is killed: a small guard between hydra and the rank.

MPICH's hydra proxy SIGKILLs every process of the job as soon as one of its direct children
dies of a signal, whatever ``-disable-auto-cleanup`` says (``proxy/pmip.c``: ``WIFSIGNALED`` ->
kill all). :func:`guard_rank` forks before MPI is initialized: the child returns and goes on to
be the rank; the parent, the process hydra launched, only waits for it and exits with its
status, a death by signal N becoming exit 128+N. Hydra then sees a rank that exited without
``MPI_Finalize``, which under ``mpiexec -disable-auto-cleanup`` leaves the other ranks running
(they get SIGUSR1: see :func:`~kvevents.producer.tolerate_peer_failures`); under the default
auto-cleanup hydra still ends the whole job, as before.

The guard closes its copy of the PMI socket (so hydra notices the rank's death at once),
ignores SIGUSR1, forwards SIGINT, SIGTERM and SIGHUP to the rank (which runs in a process group
of its own: hydra signals the guard's group, and a Ctrl-C must reach the rank once), and the
rank dies with the guard (``PR_SET_PDEATHSIG``), so a job killed by hydra leaves nothing behind. Killing the guard
itself (a few MB that only wait) ends the job as before. Linux only.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
from collections.abc import Mapping
from pathlib import Path

__all__ = ["GUARD_ENV", "guard_rank", "guarded_rank_pids", "rank_is_guarded"]

GUARD_ENV = "KVEVENTS_RANK_GUARD_PID"
"""Set in the guarded rank's environment: the guard's pid (how tools find the rank process)."""
_FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
_PR_SET_PDEATHSIG = 1


def rank_is_guarded(environ: Mapping[str, str] | None = None) -> bool:
    """Whether this process is a rank that :func:`guard_rank` forked."""
    return GUARD_ENV in (os.environ if environ is None else environ)


def guard_rank(label: str = "rank") -> None:
    """Fork: return in the child (the rank, guarded); the parent waits for it and exits.

    Call it from the main thread, before any other thread and before ``mpi4py.MPI`` is
    imported. Calling it in an already guarded rank does nothing. The parent never returns:
    it exits with the child's exit code, or 128+N when a signal N killed the child (and then
    says so on stderr, naming ``label``).
    """
    if "mpi4py.MPI" in sys.modules:
        raise RuntimeError("guard_rank() must run before mpi4py.MPI is imported (before MPI_Init)")
    if rank_is_guarded():
        return
    guard_pid = os.getpid()
    sys.stdout.flush()
    sys.stderr.flush()
    child = os.fork()
    if child == 0:
        os.environ[GUARD_ENV] = str(guard_pid)
        _own_process_group()
        _die_with_parent(guard_pid)
        return
    _own_process_group(child)
    _wait_and_exit(child, label)


def _own_process_group(pid: int = 0) -> None:
    """The rank in a process group of its own (set from both sides of the fork: no race), so
    that hydra's signals to the guard's group reach it once, forwarded, not twice."""
    with contextlib.suppress(OSError):  # the child already did it, or has exited
        os.setpgid(pid, pid)


def _die_with_parent(parent: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # the guard died before the prctl took effect
        os._exit(1)


def _wait_and_exit(child: int, label: str) -> None:
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)  # hydra's notice of a dead peer

    def forward(signum: int, frame: object) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(child, signum)

    for signum in _FORWARDED:
        signal.signal(signum, forward)
    pmi_fd = os.environ.get("PMI_FD", "")
    if pmi_fd.isdigit():  # hydra's PMI socket: only the rank may hold it open
        with contextlib.suppress(OSError):
            os.close(int(pmi_fd))
    while True:
        try:
            _, status = os.waitpid(child, 0)
            break
        except ChildProcessError:
            os._exit(1)
    code = os.waitstatus_to_exitcode(status)
    if code < 0:
        name = signal.Signals(-code).name
        print(
            f"kvevents: {label} (pid {child}) was killed by {name}; its guard exits {128 - code} "
            "(under 'mpiexec -disable-auto-cleanup' the other ranks go on)",
            file=sys.stderr,
            flush=True,
        )
        code = 128 - code
    os._exit(code)


def guarded_rank_pids(marker: str) -> dict[int, int]:
    """``{MPI world rank: pid}`` of the guarded ranks whose command line contains ``marker``
    (a guard's child with the same command line as its guard): what a fault test kills.
    Reads ``/proc``; ranks of other users are not seen."""
    found: dict[int, int] = {}
    needle = marker.encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
            if needle not in cmdline:
                continue
            parent = int((entry / "stat").read_text().rpartition(")")[2].split()[1])
            if Path(f"/proc/{parent}/cmdline").read_bytes() != cmdline:
                continue
            environ = (entry / "environ").read_bytes().split(b"\0")
        except (OSError, ValueError, IndexError):
            continue  # gone meanwhile
        for item in environ:
            if item.startswith(b"PMI_RANK="):
                found[int(item[len(b"PMI_RANK=") :])] = int(entry.name)
    return found
