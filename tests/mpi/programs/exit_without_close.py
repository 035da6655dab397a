"""Ranks != 0 flush their events and let the interpreter exit without closing their managers:
the gather's exit hook must send what they flushed and leave before mpi4py's MPI_Finalize, so
rank 0 gets everything and no process hangs at exit."""

from __future__ import annotations

import random
import time

from _common import enqueue_iteration, ids_by_rank, parser, setup_logging, world_rank, write_result
from kvevents.producer import KVCacheEventManager


def main() -> None:
    p = parser(__doc__ or "")
    args = p.parse_args()
    rank = world_rank()
    setup_logging(args.out, rank)

    from mpi4py import MPI

    world = MPI.COMM_WORLD
    size = world.Get_size()
    manager = KVCacheEventManager(100_000, rank, size, args.period_ms)
    assert manager.gather is not None
    rng = random.Random(rank)
    for _ in range(30):
        enqueue_iteration(manager, rng, 10, rank)
    world.Barrier()
    if rank != 0:
        # No close(): the manager stays referenced here, the process ends, atexit runs.
        write_result(args.out, rank, {"rank": rank, "enqueued": manager.stats().events_enqueued_total})
        globals()["kept_alive"] = manager
        return
    # Rank 0 waits until the others' exit hooks made them leave the gather, then reads everything.
    deadline = time.monotonic() + 30
    while len(manager.gather.stats().ranks_left) < size - 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    all_left = len(manager.gather.stats().ranks_left) == size - 1
    still_running = manager.gather.running  # leaving ranks do not stop rank 0's gather
    manager.close()
    got = manager.get_events(timeout=0)
    write_result(
        args.out,
        rank,
        {
            "rank": rank,
            "all_left": all_left,
            "running_after_they_left": still_running,
            "enqueued": manager.stats().events_enqueued_total,
            "received_ids": {str(r): ids for r, ids in ids_by_rank(got).items()},
            "gather": {"stop_reason": manager.gather.stats().stop_reason},
        },
    )


if __name__ == "__main__":
    main()
