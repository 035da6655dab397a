"""MPI plumbing of the attention-DP gather: the lazy mpi4py import, the gather's own
communicator, an opt-in for jobs that must outlive a dead rank, and a results collection
that a dead rank cannot hang.

Nothing here runs unless a manager is constructed with an attention-DP rank (and a size > 1):
a router or a consumer never imports mpi4py.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import sys
import time
from array import array
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

__all__ = [
    "collect_at_root",
    "find_mpiexec",
    "import_mpi",
    "split_gather_communicator",
    "tolerate_peer_failures",
]

log = logging.getLogger("kvevents.producer.gather")


def find_mpiexec() -> str | None:
    """The ``mpiexec`` beside this interpreter (the venv's, from the mpich wheel), else the one on
    PATH; None when there is none."""
    beside = Path(sys.executable).parent / "mpiexec"
    if beside.exists():
        return str(beside)
    return shutil.which("mpiexec")


def import_mpi() -> ModuleType:
    """``mpi4py.MPI``, initialized with ``MPI_THREAD_MULTIPLE``; a clear error otherwise.

    The gather calls MPI from its own thread while the engine may call MPI from others, so
    anything below ``MPI_THREAD_MULTIPLE`` (mpi4py's default) is refused.
    """
    try:
        from mpi4py import MPI
    except ImportError as exc:
        raise ImportError(
            "the attention-DP gather needs mpi4py and an MPI library "
            "(pip install 'kvevents[mpi]'), or pass attention_dp_gather=False"
        ) from exc
    if not MPI.Is_initialized() or MPI.Is_finalized():
        raise RuntimeError("the attention-DP gather needs MPI initialized (and not yet finalized)")
    if MPI.Query_thread() < MPI.THREAD_MULTIPLE:
        raise RuntimeError(
            "the attention-DP gather calls MPI from a background thread and needs "
            f"MPI_THREAD_MULTIPLE; MPI was initialized with thread level {MPI.Query_thread()} "
            "(mpi4py's default is MPI_THREAD_MULTIPLE: leave mpi4py.rc.thread_level alone)"
        )
    return MPI


def split_gather_communicator(mpi: ModuleType, parent: Any, rank: int, size: int) -> Any:
    """The gather's own communicator: ``parent.Split(0, rank)``, checked on every rank.

    Collective over ``parent``: every process of ``parent`` must call it (every rank constructs
    its manager), as ``COMM_SESSION.split(0, rank)`` in the C++. Each process then shares its
    claimed (rank, size) with the others, so that a misconfiguration (a size that differs from
    the communicator's, a rank claimed twice) raises the same ``ValueError`` on every process
    instead of leaving some of them waiting for a peer that will never talk.
    """
    if not isinstance(parent, mpi.Intracomm):
        raise TypeError(f"comm must be an mpi4py intracommunicator, got {parent!r}")
    comm = parent.Split(0, rank)
    n = comm.Get_size()
    claims = array("i", [0]) * (2 * n)
    comm.Allgather([array("i", [rank, size]), mpi.INT], [claims, mpi.INT])
    ranks = sorted(claims[0::2])
    sizes = set(claims[1::2])
    problem = None
    if sizes != {n}:
        problem = (
            f"attention_dp_size must equal the number of processes of the communicator ({n}); "
            f"the processes claim sizes {sorted(sizes)}"
        )
    elif ranks != list(range(n)):
        problem = f"every attention_dp_rank 0..{n - 1} must be claimed exactly once; claimed {ranks}"
    if problem is not None:
        comm.Free()
        hint = " (to run a DP rank without MPI, pass attention_dp_gather=False)" if n == 1 else ""
        raise ValueError(f"attention-DP gather: {problem}{hint}")
    return comm


def tolerate_peer_failures() -> None:
    """Opt in to surviving a dead peer under MPICH's ``mpiexec -disable-auto-cleanup``.

    Call it from the main thread BEFORE MPI is initialized (before ``from mpi4py import MPI``).
    It (1) ignores SIGUSR1: hydra sends SIGUSR1 to every survivor when a rank dies (and again
    whenever a process ends without finalizing the usual way), and SIGUSR1's default action
    terminates a Python process; ignored rather than handled in Python, because Python restores
    the default action of its own handlers when the interpreter shuts down, which is exactly
    when the other survivors' exits send more SIGUSR1; and (2) sets
    ``MPIR_CVAR_NO_COLLECTIVE_FINALIZE=1`` unless already set: without it, ``MPI_Finalize``
    on a survivor waits forever for the dead peer.

    Neither is needed with hydra's default (auto-cleanup): there any rank that dies makes
    hydra SIGKILL the whole job at once. See :mod:`kvevents.producer.gather` for the details.
    """
    if "mpi4py.MPI" in sys.modules:
        log.warning(
            "tolerate_peer_failures() called after mpi4py.MPI was imported: "
            "MPIR_CVAR_NO_COLLECTIVE_FINALIZE only takes effect before MPI_Init"
        )
    os.environ.setdefault("MPIR_CVAR_NO_COLLECTIVE_FINALIZE", "1")
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    log.info(
        "tolerating peer failures: SIGUSR1 ignored, MPIR_CVAR_NO_COLLECTIVE_FINALIZE=%s",
        os.environ["MPIR_CVAR_NO_COLLECTIVE_FINALIZE"],
    )


def collect_at_root(
    comm: Any,
    payload: bytes,
    *,
    tag: int,
    timeout_s: float,
    known_gone: Callable[[dict[int, bytes]], set[int]] | None = None,
    poll_s: float = 0.005,
) -> dict[int, bytes] | None:
    """Every process's ``payload`` at rank 0 of ``comm``, without a collective: a dead rank
    cannot hang it.

    Ranks != 0 send theirs (``Issend``: done once rank 0 matched it) and return None, giving up
    after ``timeout_s`` (rank 0 dead). Rank 0 returns ``{rank: payload}`` with its own, once
    every other rank's arrived or the missing ones are in ``known_gone(received)`` (e.g. ranks
    that a peer reported dead), or after ``timeout_s``: a missing rank is simply absent.
    """
    mpi = import_mpi()
    rank, size = comm.Get_rank(), comm.Get_size()
    deadline = time.monotonic() + timeout_s
    if rank != 0:
        request = comm.Issend([payload, mpi.BYTE], dest=0, tag=tag)
        while not request.Test():
            if time.monotonic() >= deadline:
                log.warning("rank %d: rank 0 did not take its result within %.0f s", rank, timeout_s)
                return None
            time.sleep(poll_s)
        return None
    received = {0: payload}
    status = mpi.Status()
    while len(received) < size:
        message = comm.Improbe(mpi.ANY_SOURCE, tag, status)
        if message is not None:
            data = bytearray(status.Get_count(mpi.BYTE))
            message.Recv([data, mpi.BYTE])
            received[status.Get_source()] = bytes(data)
            continue
        missing = set(range(size)) - set(received)
        gone = known_gone(received) if known_gone is not None else set()
        if missing <= gone:
            break
        if time.monotonic() >= deadline:
            log.warning("rank 0: no result from ranks %s within %.0f s", sorted(missing - gone), timeout_s)
            break
        time.sleep(poll_s)
    return received
