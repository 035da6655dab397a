"""Every rank enqueues a seeded stream; rank 0's manager feeds a ``KafkaEventSink`` on a real
broker. After a barrier rank 0 closes its manager (the gather's final exchange brings every
rank's last events), then the sink (which delivers everything it drained). The test reads the
topic. With a small ``--max-entries`` the buffers overflow and the drops must travel in-band."""

from __future__ import annotations

import dataclasses
import random
import time

from _common import enqueue_iteration, parser, setup_logging, world_rank, write_result
from kvevents.producer import GatherConfig, KafkaEventSink, KVCacheEventManager


def main() -> None:
    p = parser(__doc__ or "")
    p.add_argument("--bootstrap", required=True)
    p.add_argument("--topic", required=True)
    p.add_argument("--iterations", type=int, default=200)
    p.add_argument("--events", type=int, default=20)
    p.add_argument("--max-entries", type=int, default=1_000_000)
    args = p.parse_args()
    rank = world_rank()
    setup_logging(args.out, rank)

    from mpi4py import MPI

    world = MPI.COMM_WORLD
    size = world.Get_size()
    manager = KVCacheEventManager(
        args.max_entries, rank, size, args.period_ms, drop_warning_interval_s=3600,
        gather_config=GatherConfig(shutdown_timeout_s=10.0),
    )  # fmt: skip
    sink = None
    if rank == 0:
        sink = KafkaEventSink(manager, args.topic, "engine-a", config={"bootstrap.servers": args.bootstrap})
    rng = random.Random(rank)
    for _ in range(args.iterations):
        enqueue_iteration(manager, rng, args.events, rank)
        time.sleep(0.001)
    world.Barrier()
    result: dict[str, object] = {"rank": rank, "enqueued": manager.stats().events_enqueued_total}
    if rank == 0:
        assert sink is not None
        manager.close()  # every rank's last events are merged before this returns
        report = sink.close(timeout=60)
        result["sink"] = dataclasses.asdict(sink.stats())
        result["close_report"] = dataclasses.asdict(report)
    else:
        assert manager.gather is not None
        manager.gather.join(timeout=30)
        manager.close()
    result["buffer"] = dataclasses.asdict(manager.stats().buffer)
    write_result(args.out, rank, result)


if __name__ == "__main__":
    main()
