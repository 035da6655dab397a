"""Losses at rank 0 reach the rank whose events were lost: rank 0's buffer overflows with rank
1's events (rank 1's own buffer never does), so rank 1's manager raises ``snapshot_requested``
through a RESYNC message; then rank 0 reports losses itself (as its Kafka sink does): an old one,
covered by rank 1's latest snapshot, is ignored there; a new one of rank 2 raises rank 2's."""

from __future__ import annotations

import random

from _common import enqueue_iteration, parser, setup_logging, wait_for, world_rank, write_result
from kvevents.producer import KVCacheEventManager, ProducerMetrics

PER_RANK = 50  # rank 0 holds 3 x 50 events and never drains in phase 1


def main() -> None:
    args = parser(__doc__ or "").parse_args()
    rank = world_rank()
    setup_logging(args.out, rank)

    from mpi4py import MPI

    world = MPI.COMM_WORLD
    size = world.Get_size()
    result: dict[str, object] = {}
    with KVCacheEventManager(PER_RANK, rank, size, args.period_ms, comm=world) as manager:
        # Phase 1: rank 1 sends 300 events in small iterations (its buffer of 50 never fills).
        if rank == 1:
            rng = random.Random(1)
            for _ in range(30):
                enqueue_iteration(manager, rng, 10, rank)
                manager.settle(5)
                wait_for(lambda: manager.buffer.stats().buffered_events == 0, 5)
        world.Barrier()
        if rank == 1:
            result["phase1_requested"] = wait_for(lambda: manager.snapshot_requested, 10)
            result["phase1_reason"] = manager.snapshot_request_reason
            result["own_buffer_drops"] = manager.stats().buffer.events_dropped_total
            manager.enqueue_snapshot({}, [100])  # clears the request; later ids are newer
            manager.flush()
            result["after_snapshot_requested"] = manager.snapshot_requested
        if rank == 0:
            assert manager.gather is not None
            gather = manager.gather
            result["phase1_received"] = wait_for(lambda: gather.stats().events_received_total >= 300, 10)
            result["phase1_drops"] = {
                str(r): n for r, n in manager.stats().buffer.events_dropped_by_rank.items()
            }
        world.Barrier()
        # Phase 2: rank 0 reports losses of rank 1's event 5 (before its snapshot) and rank 2's.
        if rank == 0:
            manager.report_lost_events(1, 3, 5, where="in a test")
            manager.report_lost_events(2, 1, None, where="in a test")
        if rank == 2:
            result["phase2_requested"] = wait_for(lambda: manager.snapshot_requested, 10)
            result["phase2_reason"] = manager.snapshot_request_reason
        world.Barrier()  # rank 2 got its RESYNC, so rank 1 (sent first) got its own
        if rank == 1:
            result["phase2_requested"] = manager.snapshot_requested
            assert manager.gather is not None
            result["resyncs_received"] = manager.gather.stats().resyncs_received_total
            result["metric_resyncs_received"] = ProducerMetrics(manager).value(
                "kvevents_gather_resyncs_received_total"
            )
        if rank == 0:
            assert manager.gather is not None
            result["resyncs_sent"] = manager.gather.stats().resyncs_sent_total
            result["metric_resyncs_sent"] = ProducerMetrics(manager).value(
                "kvevents_gather_resyncs_sent_total"
            )
    write_result(args.out, rank, result)


if __name__ == "__main__":
    main()
