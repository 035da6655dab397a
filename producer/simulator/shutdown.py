"""The shutdown rounds' MPI helpers of simulated ranks: a barrier and an "any rank?" vote that
give up after a timeout, or at once when a rank of the instance is known dead (it would never
meet the others), so a dead rank cannot hang the survivors' shutdown."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from ..manager import KVCacheEventManager

__all__ = ["DEAD_RANK_TAG", "FINISH_TIMEOUT_S", "DeadRankNotice", "any_rank", "barrier", "wait_for_instance"]

log = logging.getLogger("kvevents.producer.simulator.run")

DEAD_RANK_TAG = 7302


class DeadRankNotice:
    """The shutdown rounds' way out when a rank of the instance is dead (it would never meet the
    others): rank 0's gather knows, tells the live ranks (a tiny message on the instance's
    communicator), and every rank stops waiting."""

    def __init__(self, comm: Any, manager: KVCacheEventManager, label: str) -> None:
        self.comm = comm
        self.manager = manager
        self.label = label
        self.known = False
        self._sends: list[Any] = []

    def __call__(self) -> bool:
        if self.known:
            return True
        gather = self.manager.gather
        if self.comm.Get_rank() != 0:
            self.known = bool(self.comm.Iprobe(source=0, tag=DEAD_RANK_TAG))
        elif gather is not None and (dead := gather.stats().ranks_dead):
            self.known = True
            for rank in range(1, self.comm.Get_size()):
                if rank not in dead:
                    self._sends.append(self.comm.Isend([b"\0", 1, _mpi_byte()], dest=rank, tag=DEAD_RANK_TAG))
        if self.known:
            log.warning(
                "%s: a rank of the instance is dead; the last snapshot rounds are skipped", self.label
            )
        return self.known


def _mpi_byte() -> Any:
    from mpi4py import MPI

    return MPI.BYTE


def _wait(request: Any, timeout: float, give_up: Callable[[], bool] | None = None) -> bool:
    deadline = time.monotonic() + timeout
    while not request.Test():
        if give_up is not None and give_up():
            return False
        if time.monotonic() >= deadline:
            log.warning("ranks of the instance did not meet within %.0f s at shutdown", timeout)
            return False
        time.sleep(0.005)
    return True


def barrier(comm: Any, timeout: float, give_up: Callable[[], bool] | None = None) -> bool:
    """A barrier that gives up after ``timeout`` seconds or once ``give_up()`` (a failed rank
    never arrives)."""
    return _wait(comm.Ibarrier(), timeout, give_up)


def any_rank(comm: Any, flag: bool, timeout: float, give_up: Callable[[], bool] | None = None) -> bool:
    """Whether ``flag`` is set on any rank (False if the ranks do not meet in time)."""
    from array import array

    from mpi4py import MPI

    send, receive = array("i", [int(flag)]), array("i", [0])
    return _wait(comm.Iallreduce(send, receive, op=MPI.MAX), timeout, give_up) and bool(receive[0])


FINISH_TIMEOUT_S = 120.0
"""How long a rank that finished waits for the slowest rank of its instance before closing."""


def wait_for_instance(
    comm: Any, manager: KVCacheEventManager, label: str, timeout: float = FINISH_TIMEOUT_S
) -> bool:
    """Wait until every rank of the instance has finished producing, before this rank closes
    its manager. Rank 0's close stops the attention-DP gather on every rank, so a rank still
    producing then would keep its later events in its own buffer, where nobody forwards them
    nor reports their loss in-band (another rank's close stops only that rank). Gives up when a
    rank is known dead, when the gather already stopped (waiting gains nothing), or after
    ``timeout`` seconds; False then."""
    dead = DeadRankNotice(comm, manager, label)

    def give_up() -> bool:
        gather = manager.gather
        return dead() or gather is None or not gather.running

    met = _wait(comm.Ibarrier(), timeout, give_up)
    if not met:
        log.warning("%s: closing before every rank of the instance finished producing", label)
    return met
