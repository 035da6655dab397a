"""The MPI side of ``bench/gather.py``: one rank's run of every case (``--worker`` mode).

Each case builds fresh managers for one exchange (``kvevents``, ``kvevents-py``, ``lockstep`` or
``none``), runs the steady phases, the idle phase and the throughput phase, and returns the raw
timings for ``gather_report.summarize``; ``worker`` writes them to ``rank<N>.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import threading
import time
from array import array
from typing import Any

EVENTS_PER_ITERATION = 50


def engine_iteration(manager: Any, blocks: list[Any], updates: list[Any], hashes: list[int], i: int) -> None:
    """50 events: 25 Stored (1 block x 32 tokens), 20 Removed (alternating windows: no merge),
    5 Updated; then flush. Arguments are prebuilt: the engine hands over existing objects."""
    stored = manager.enqueue_stored_event
    removed = manager.enqueue_removed_event
    updated = manager.enqueue_updated_event
    base = (i * 25) % len(blocks)
    for k in range(25):
        stored(blocks[base + k], 32)
    for k in range(20):
        removed(hashes[k], 33 + (k & 1))
    for k in range(5):
        updated(updates[k], 32)
    manager.flush()


def run_case(protocol: str, args: argparse.Namespace, world: Any, rank: int, size: int) -> dict[str, Any]:
    from kvevents.producer import BlockInfo, KVCacheEventManager
    from kvevents.producer._recorder import PyRecorder
    from kvevents.schemas import KVCacheEventDiff, KVCacheUpdatedData
    from lockstep import LockstepManager

    class PurePythonManager(KVCacheEventManager):
        _recorder_factory = PyRecorder

    chain = [BlockInfo(1000 + j, 999 + j if j else None, list(range(j, j + 32))) for j in range(2000)]
    blocks = [[b] for b in chain]
    blocks += blocks[:25]
    updates = [KVCacheUpdatedData(7 + k, priority=KVCacheEventDiff(35, 90)) for k in range(5)]
    hashes = [1_000_000 + k for k in range(20)]

    world.Barrier()
    capacity = 2 * args.throughput_events  # no drop by construction (drops are reported anyway)
    manager: Any  # a LockstepManager or a KVCacheEventManager: the same interface here
    if protocol == "lockstep":
        manager = LockstepManager(capacity, rank, size, args.period_ms, drop_warning_interval_s=3600)
    else:  # "none": the same manager without any exchange, the floor of the engine's cost
        gathering = protocol != "none"
        manager_class = PurePythonManager if protocol == "kvevents-py" else KVCacheEventManager
        manager = manager_class(
            capacity, rank, size, args.period_ms, drop_warning_interval_s=3600, attention_dp_gather=gathering
        )
    exchanging = protocol != "none"
    arrivals: list[tuple[float, int, int, int, int]] = []  # (time, rank, first id, last id, count)
    acks: list[tuple[float, dict[int, int], dict[int, int]]] = []  # (acked at, events, last id) per rank
    stop_reader = threading.Event()
    reader = None
    sink = None
    if rank == 0:
        extend, extend_encoded = manager.buffer.extend, manager.buffer.extend_encoded

        def stamped(events: Any) -> int:
            dropped = extend(events)
            if events:
                first = events[0]
                arrivals.append(
                    (
                        time.monotonic(),
                        first.attention_dp_rank,
                        first.event_id,
                        events[-1].event_id,
                        len(events),
                    )
                )
            return dropped

        def stamped_encoded(events: Any, windows: Any) -> int:
            # the other ranks' events as the gather received them (rank 0 passes their bytes
            # through): the same record, read from the encoded events' ids and ranks
            dropped = extend_encoded(events, windows)
            if len(events):
                n = len(events)
                arrivals.append(
                    (time.monotonic(), events.rank(0), events.event_id(0), events.event_id(n - 1), n)
                )
            return dropped

        manager.buffer.extend = stamped  # type: ignore[method-assign]
        manager.buffer.extend_encoded = stamped_encoded  # type: ignore[method-assign]

        def read() -> None:
            while not stop_reader.is_set():
                manager.drain(timeout=0.05)

        reader = threading.Thread(target=read, daemon=True)
        reader.start()

    def attach_sink() -> None:
        """Rank 0 as deployed: stop the reader, let a Kafka sink drain the manager instead."""
        nonlocal sink, reader
        if reader is not None:
            stop_reader.set()
            reader.join()
            reader = None
        from kvevents.consumer.topics import TopicSpec, create_topic
        from kvevents.producer import KafkaEventSink

        topic = f"bench-gather-{protocol}-{os.getpid()}-{time.monotonic_ns()}"
        create_topic(args.bootstrap, TopicSpec(topic))

        def on_delivery(report: Any) -> None:
            if report.delivered:
                acks.append((report.acked_at, report.events_by_rank, report.last_event_id_by_rank))

        sink = KafkaEventSink(
            manager, topic, "bench", config={"bootstrap.servers": args.bootstrap}, on_delivery=on_delivery
        )

    def wait_delivered(expected_total: int, timeout: float) -> float | None:
        """Rank 0: wait until ``expected_total`` events arrived; the last arrival's time."""
        deadline = time.monotonic() + timeout
        while sum(a[4] for a in arrivals) < expected_total:
            if time.monotonic() > deadline:
                return None
            time.sleep(0.002)
        return arrivals[-1][0] if arrivals else None

    def wait_acked(expected_total: int, timeout: float) -> float | None:
        """Rank 0 with a sink: wait until Kafka acknowledged ``expected_total`` events."""
        deadline = time.monotonic() + timeout
        while sum(sum(a[1].values()) for a in list(acks)) < expected_total:
            if time.monotonic() > deadline:
                return None
            time.sleep(0.005)
        return max(a[0] for a in acks) if acks else None

    steady: dict[str, dict[str, Any]] = {}
    iteration = 0

    def steady_phase(label: str, gap_ms: float) -> None:
        nonlocal iteration
        world.Barrier()
        costs_ns = array("q")
        starts = array("d")
        first_id = iteration * EVENTS_PER_ITERATION
        cpu0, wall0 = time.process_time(), time.monotonic()
        for _ in range(args.iterations):
            t_start = time.monotonic()
            p0 = time.perf_counter_ns()
            engine_iteration(manager, blocks, updates, hashes, iteration)
            costs_ns.append(time.perf_counter_ns() - p0)
            starts.append(t_start)
            iteration += 1
            time.sleep(gap_ms / 1000)
        cpu = (time.process_time() - cpu0) / (time.monotonic() - wall0)
        total = world.allreduce(args.iterations * EVENTS_PER_ITERATION)
        complete = wait_delivered(total, 30) is not None if rank == 0 and exchanging else True
        acked = wait_acked(total, 60) is not None if sink is not None else None
        steady[label] = {
            "engine_costs_ns": list(costs_ns),
            "iteration_starts": list(starts),
            "first_event_id": first_id,
            "cpu": cpu,
            "arrivals": list(arrivals),
            "complete": complete,
            "acks": [
                (t, {str(r): n for r, n in by.items()}, {str(r): i for r, i in last.items()})
                for t, by, last in acks
            ],
            "acked_complete": acked,
        }
        arrivals.clear()
        acks.clear()

    # -- steady, rank 0 drained by a reader: the gather alone ------------------------------------
    for gap_ms in args.gaps_ms:
        steady_phase(f"{gap_ms:g}", gap_ms)

    # -- idle ----------------------------------------------------------------------------------
    world.Barrier()
    time.sleep(1.2)  # the manager's worker parks after 1 s without work
    cpu0, wall0 = time.process_time(), time.monotonic()
    time.sleep(args.idle_s)
    idle_cpu = (time.process_time() - cpu0) / (time.monotonic() - wall0)

    # -- with Kafka: rank 0's manager drained by the sink, the broker on the same cores -------------
    if rank == 0 and exchanging and args.bootstrap:
        attach_sink()
    if args.bootstrap:
        steady_phase(f"{args.gaps_ms[0]:g}+kafka", args.gaps_ms[0])

    # -- throughput ------------------------------------------------------------------------------
    world.Barrier()
    t0 = time.monotonic()
    n_iterations = args.throughput_events // EVENTS_PER_ITERATION if exchanging else 0
    interval = EVENTS_PER_ITERATION / (args.offered_rate / size)  # this rank's share of the load
    for i in range(n_iterations):
        delay = t0 + i * interval - time.monotonic()
        if delay > 0:
            time.sleep(delay)  # on schedule; behind it, no sleep (the load is offered, not adapted)
        engine_iteration(manager, blocks, updates, hashes, iteration)
        iteration += 1
    produced_s = time.monotonic() - t0
    total = world.allreduce(n_iterations * EVENTS_PER_ITERATION)
    last = wait_delivered(total, 120) if rank == 0 and exchanging else None
    delivered = sum(a[4] for a in arrivals)
    last_ack = wait_acked(total, 120) if sink is not None else None
    kafka_acked = sum(sum(a[1].values()) for a in acks)

    world.Barrier()
    stop_reader.set()
    if reader is not None:
        reader.join()
    manager.close()
    sink_stats = None
    if sink is not None:
        sink.close(timeout=60)
        sink_stats = sink.stats()
    stats = manager.stats().buffer
    result: dict[str, Any] = {
        "protocol": protocol,
        "rank": rank,
        "steady": steady,
        "idle_cpu": idle_cpu,
        "throughput_produced_s": produced_s,
        "dropped_total": stats.events_dropped_total,
    }
    if rank == 0:
        result.update(
            throughput_events=delivered,
            throughput_expected=total,
            throughput_s=(last - t0) if last is not None else None,
            kafka_acked=kafka_acked if sink is not None else None,
            kafka_s=(last_ack - t0) if last_ack is not None else None,
            sink_events_lost=dict(sink_stats.events_lost_by_rank) if sink_stats is not None else None,
        )
        if protocol.startswith("kvevents"):
            gather = manager.gather
            assert gather is not None
            result["gather_stats"] = dataclasses.asdict(gather.stats())
    return result


def worker(args: argparse.Namespace) -> None:
    rank = int(os.environ.get("PMI_RANK", "0"))
    logging.basicConfig(level=logging.WARNING)
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    size = world.Get_size()
    if args.bootstrap:
        # Warm the broker (JIT, coordinator, page cache) so that the first measured case is not
        # charged for it; discarded.
        warm = argparse.Namespace(**{**vars(args), "iterations": 200, "gaps_ms": [1.0], "throughput_events": 20_000,
                                      "idle_s": 0.1})  # fmt: skip
        run_case("kvevents", warm, world, rank, size)
    cases = []
    for repeat in range(args.repeats):
        # Rotated: over len(protocols) repeats each protocol runs once in every position (the
        # first case of a repeat measured slower, whichever protocol it was).
        shift = repeat % len(args.protocols)
        order = [*args.protocols[shift:], *args.protocols[:shift]]
        for protocol in order:
            case = run_case(protocol, args, world, rank, size)
            case["repeat"] = repeat
            cases.append(case)
    (args.out / f"rank{rank}.json").write_text(json.dumps(cases))
