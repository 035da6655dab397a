"""Every rank enqueues a seeded stream of events while the engine uses COMM_WORLD with the same
tags as the gather; after a barrier one rank (``--closer``) closes its manager first.

Rank 0 reads its manager with ``drain`` in a reader thread, as a Kafka sink would, and rebuilds
each rank's expected events with a local manager fed the same seeded stream (no MPI), so the
test can compare content, not only ids. With ``--slow-reader-ms`` and a small
``--max-entries`` the buffers overflow (the drop-count test).
"""

from __future__ import annotations

import dataclasses
import random
import time
from array import array

from _common import (
    DrainingReader,
    enqueue_iteration,
    fail,
    ids_by_rank,
    parser,
    setup_logging,
    world_rank,
    write_result,
)
from kvevents.producer import GatherConfig, KVCacheEventManager
from kvevents.schemas import KVCacheEvent


def expected_events(rank: int, size: int, iterations: int, events: int) -> list[KVCacheEvent]:
    """Rank ``rank``'s events as its own manager builds them (same seed, no gather)."""
    with KVCacheEventManager(10**7, rank, size, attention_dp_gather=False) as shadow:
        rng = random.Random(rank)
        for _ in range(iterations):
            enqueue_iteration(shadow, rng, events, rank)
        shadow.settle(30)
        return shadow.get_events(timeout=0)


def main() -> None:
    p = parser(__doc__ or "")
    p.add_argument("--iterations", type=int, default=200)
    p.add_argument("--events", type=int, default=20, help="events per iteration")
    p.add_argument("--max-entries", type=int, default=1_000_000)
    p.add_argument("--closer", type=int, default=0, help="the rank that closes first")
    p.add_argument("--slow-reader-ms", type=float, default=0.0, help="rank 0 reader pause between drains")
    p.add_argument("--pause-every", type=int, default=1, help="sleep 1 ms every this many iterations")
    p.add_argument(
        "--after-stop", type=int, default=0, help="iterations a rank != 0 runs after the closer closed"
    )
    args = p.parse_args()
    rank = world_rank()
    setup_logging(args.out, rank)

    from mpi4py import MPI

    world = MPI.COMM_WORLD
    size = world.Get_size()
    config = GatherConfig(heartbeat_interval_s=0.2, heartbeat_timeout_s=5.0, shutdown_timeout_s=10.0)
    manager = KVCacheEventManager(
        args.max_entries, rank, size, args.period_ms, drop_warning_interval_s=3600, gather_config=config
    )
    assert manager.gather is not None

    reader = DrainingReader(manager, pause_s=args.slow_reader_ms / 1000)
    got, drops = reader.got, reader.drops
    if rank == 0:
        reader.start()

    # The engine's own MPI traffic: COMM_WORLD, the gather's tag numbers, every iteration.
    engine_received = 0
    rng = random.Random(rank)
    for iteration in range(args.iterations):
        enqueue_iteration(manager, rng, args.events, rank)
        if rank == 0:
            for source in range(1, size):
                note = array("q", [0, 0])
                world.Recv([note, MPI.INT64_T], source, 1 + iteration % 5)
                if list(note) != [source, iteration]:
                    fail(
                        args.out, rank, f"engine message mixed up: {list(note)} from {source} at {iteration}"
                    )
                engine_received += 1
        else:
            world.Send([array("q", [rank, iteration]), MPI.INT64_T], 0, 1 + iteration % 5)
        if iteration % args.pause_every == 0:
            time.sleep(0.001)
    world.Barrier()  # every rank has flushed everything: all of it must reach rank 0

    enqueued_before_stop = manager.stats().events_enqueued_total
    if rank == args.closer:
        manager.close()
    elif args.closer == 0:
        if not manager.gather.join(timeout=30):
            fail(args.out, rank, "the gather did not stop after rank 0 closed")
    elif manager.gather.join(timeout=0.5):
        fail(args.out, rank, f"the gather stopped when rank {args.closer} closed")
    if rank != 0 and rank != args.closer:
        # After rank 0 closed these stay on this rank; after another rank closed they still go.
        for _ in range(args.after_stop):
            enqueue_iteration(manager, rng, args.events, rank)
        manager.close()
    world.Barrier()  # rank 0 closes last (unless it is the closer): nobody is left behind
    manager.close()
    leftover = manager.get_events(timeout=0) if rank else []  # rank 0's reader takes its own
    result = {
        "rank": rank,
        "size": size,
        "enqueued": manager.stats().events_enqueued_total,
        "enqueued_before_stop": enqueued_before_stop,
        "gather": dataclasses.asdict(manager.gather.stats()),
        "buffer": dataclasses.asdict(manager.stats().buffer),
        "leftover_local_events": len(leftover) if rank else None,
        "engine_messages_received": engine_received,
    }
    if rank == 0:
        if not reader.finished(30):
            fail(args.out, rank, "rank 0 reader did not finish")
        result["received_ids"] = {str(r): ids for r, ids in ids_by_rank(got).items()}
        result["dropped_by_rank"] = {str(r): n for r, n in drops.items()}
        mismatches = {}
        for r in range(size):
            ran_after = args.closer != 0 and r not in (0, args.closer)  # and were delivered
            iterations = args.iterations + (args.after_stop if ran_after else 0)
            expected = {e.event_id: e for e in expected_events(r, size, iterations, args.events)}
            bad = [e.event_id for e in got if e.attention_dp_rank == r and expected.get(e.event_id) != e]
            if bad:
                mismatches[str(r)] = bad[:10]
        result["content_mismatches"] = mismatches
    write_result(args.out, rank, result)


if __name__ == "__main__":
    main()
