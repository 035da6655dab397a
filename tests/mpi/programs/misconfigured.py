"""Managers constructed with a DP configuration that does not match the communicator: every
process must get the same ``ValueError`` (none may wait for a peer), then a correct one works
on the same communicator."""

from __future__ import annotations

from _common import parser, setup_logging, world_rank, write_result
from kvevents.producer import KVCacheEventManager


def main() -> None:
    p = parser(__doc__ or "")
    args = p.parse_args()
    rank = world_rank()
    setup_logging(args.out, rank)

    from mpi4py import MPI

    world = MPI.COMM_WORLD
    size = world.Get_size()
    errors = {}
    cases = {
        "size_too_big": (rank, size + 1),
        "rank_claimed_twice": (min(rank, size - 2), size),
    }
    for name, (dp_rank, dp_size) in cases.items():
        try:
            KVCacheEventManager(10, dp_rank, dp_size, comm=world).close()
        except ValueError as exc:
            errors[name] = str(exc)
    with KVCacheEventManager(10, rank, size, comm=world) as manager:
        manager.enqueue_created_event([1], 16)
    write_result(args.out, rank, {"errors": errors, "ok": True})


if __name__ == "__main__":
    main()
