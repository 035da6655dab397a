"""Rank 0 is stopped (SIGSTOP) for ``--stall-s`` while the other ranks keep producing into small
buffers: their sends back up to ``max_in_flight``, the rest waits in their bounded buffers,
which drop the oldest events and count them. Once rank 0 continues, per rank, what reaches it
plus what was reported dropped must equal what was enqueued, in order, nobody declared dead."""

from __future__ import annotations

import dataclasses
import os
import random
import signal
import subprocess
import time

from _common import (
    DrainingReader,
    enqueue_iteration,
    ids_by_rank,
    parser,
    setup_logging,
    world_rank,
    write_result,
)
from kvevents.producer import GatherConfig, KVCacheEventManager


def main() -> None:
    p = parser(__doc__ or "")
    p.add_argument("--stall-s", type=float, default=1.5)
    p.add_argument("--max-entries", type=int, default=2000)
    args = p.parse_args()
    rank = world_rank()
    setup_logging(args.out, rank)

    from mpi4py import MPI

    world = MPI.COMM_WORLD
    size = world.Get_size()
    config = GatherConfig(
        heartbeat_interval_s=0.1, heartbeat_timeout_s=1.0, shutdown_timeout_s=10.0, max_in_flight=2,
        max_events_per_message=256,
    )  # fmt: skip
    manager = KVCacheEventManager(
        args.max_entries, rank, size, args.period_ms, drop_warning_interval_s=3600, gather_config=config
    )
    assert manager.gather is not None
    reader = DrainingReader(manager)
    got, drops = reader.got, reader.drops
    rng = random.Random(rank)
    world.Barrier()
    if rank == 0:
        reader.start()
        subprocess.Popen(["sh", "-c", f"sleep {args.stall_s}; kill -CONT {os.getpid()}"])
        os.kill(os.getpid(), signal.SIGSTOP)  # continues after --stall-s
    else:
        end = time.monotonic() + args.stall_s + 0.5
        while time.monotonic() < end:  # about 50k events/s per rank, most while rank 0 is stopped
            enqueue_iteration(manager, rng, 50, rank)
            # Flat out until this rank's buffer drops: besides max_in_flight messages, the MPI
            # library's eager buffers hold sends too (MPICH: 64 cells of 8 KiB per process).
            time.sleep(0.001 if manager.stats().buffer.events_dropped_total else 0)
    world.Barrier()
    if rank == 0:
        time.sleep(0.5)
        manager.close()
        reader.finished(30)
    else:
        manager.gather.join(timeout=30)
        manager.close()
    result = {
        "rank": rank,
        "enqueued": manager.stats().events_enqueued_total,
        "gather": dataclasses.asdict(manager.gather.stats()),
        "buffer": dataclasses.asdict(manager.stats().buffer),
    }
    if rank == 0:
        result["received_ids"] = {str(r): ids for r, ids in ids_by_rank(got).items()}
        result["dropped_by_rank"] = {str(r): n for r, n in drops.items()}
    write_result(args.out, rank, result)


if __name__ == "__main__":
    main()
