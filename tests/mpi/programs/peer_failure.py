"""One rank (``--victim``) fails while the others keep producing events; rank 0 must notice,
report it, keep gathering the others, and still shut down cleanly. ``--how``:

- ``sigkill``: the victim's MPI process is SIGKILLed after flushing events it never got to send.
  It runs as the child of a small parent that hydra sees instead (the parent waits, records the
  child's fate, and exits 0 once rank 0 is done): hydra SIGKILLs the whole job when it sees a
  rank die of a signal, which would end this test before rank 0 could show what it does (the
  test of that hydra policy runs the victim without the parent).
- ``exit``: the victim's process exits (status 1) without ``MPI_Finalize``, as after an uncaught
  exception; under ``-disable-auto-cleanup`` the survivors go on and finalize normally.
- ``stall``: the victim's process is stopped (SIGSTOP) for ``--stall-s`` seconds, longer than
  the heartbeat timeout, then continues: declared dead, then taken back; the others' events
  keep flowing during the stall.

Survivors coordinate through files in ``--out`` (no collective may involve a dead rank).
"""

from __future__ import annotations

import dataclasses
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

from _common import (
    DrainingReader,
    enqueue_iteration,
    fail,
    ids_by_rank,
    parser,
    setup_logging,
    wait_for,
    world_rank,
    write_json,
    write_result,
)
from kvevents.producer import EventDrain, GatherConfig, KVCacheEventManager, tolerate_peer_failures


def run_parent_of_victim(child: int, out: Path) -> None:
    """What hydra sees as the victim rank: wait for the MPI child, record how it ended, stay
    until rank 0 has written its result, exit 0."""
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    _, status = os.waitpid(child, 0)
    fate = {
        "signaled": os.WIFSIGNALED(status),
        "signal": os.WTERMSIG(status) if os.WIFSIGNALED(status) else None,
    }
    write_json(Path(out), "victim_fate", fate)
    wait_for(lambda: (out / "rank0.json").exists(), 60, 0.05)
    os._exit(0)


def main() -> None:
    p = parser(__doc__ or "")
    p.add_argument("--victim", type=int, default=2)
    p.add_argument("--how", choices=["sigkill", "exit", "stall"], required=True)
    p.add_argument("--hydra-sees-death", action="store_true", help="sigkill: no parent process in between")
    p.add_argument("--stall-s", type=float, default=1.6)
    p.add_argument("--phase2-s", type=float, default=2.5)
    p.add_argument("--heartbeat-timeout-s", type=float, default=1.0)
    args = p.parse_args()
    rank = world_rank()
    victim = rank == args.victim
    if victim and args.how == "sigkill" and not args.hydra_sees_death:
        child = os.fork()
        if child:
            run_parent_of_victim(child, args.out)
    tolerate_peer_failures()  # before MPI_Init: survive hydra's SIGUSR1, finalize without the dead
    setup_logging(args.out, rank)

    from mpi4py import MPI

    world = MPI.COMM_WORLD
    size = world.Get_size()
    config = GatherConfig(
        heartbeat_interval_s=0.1, heartbeat_timeout_s=args.heartbeat_timeout_s, shutdown_timeout_s=5.0
    )
    manager = KVCacheEventManager(
        100_000, rank, size, args.period_ms, drop_warning_interval_s=3600, gather_config=config
    )
    assert manager.gather is not None
    rng = random.Random(rank)

    arrivals: list[tuple[float, int, int]] = []  # (time, rank, events) per drain
    victim_drops: list[tuple[float, int]] = []

    def note(drain: EventDrain, now: float) -> None:
        for r, ids in ids_by_rank(drain.events).items():
            arrivals.append((now, r, len(ids)))
        victim_drops.extend(
            (now, d.dropped_events) for d in drain.dropped if d.attention_dp_rank == args.victim
        )

    reader = DrainingReader(manager, on_drain=note)
    got = reader.got
    if rank == 0:
        reader.start()

    # Phase 1: everyone, then a last collective while everyone is alive.
    for _ in range(50):
        enqueue_iteration(manager, rng, 10, rank)
        time.sleep(0.002)
    world.Barrier()
    time.sleep(0.2)  # every rank's phase-1 events have been gathered

    if victim:
        timeline = {"enqueued_before": manager.stats().events_enqueued_total, "pid": os.getpid()}
        if args.how == "stall":
            timeline["stopped_at"] = time.monotonic()
            write_json(args.out, "victim", timeline)
            subprocess.Popen(["sh", "-c", f"sleep {args.stall_s}; kill -CONT {os.getpid()}"])
            os.kill(os.getpid(), signal.SIGSTOP)
        else:
            # 100 more events, flushed just before dying: most likely never sent.
            timeline["sent_events"] = manager.gather.stats().events_sent_total
            timeline["enqueued_total"] = timeline["enqueued_before"] + 100
            timeline["died_at"] = time.monotonic()
            write_json(args.out, "victim", timeline)
            for _ in range(10):
                enqueue_iteration(manager, rng, 10, rank)
            if args.how == "exit":
                os._exit(1)
            os.kill(os.getpid(), signal.SIGKILL)

    # Phase 2: the survivors (and a stalled victim once it continues) keep producing.
    phase2_end = time.monotonic() + args.phase2_s
    while time.monotonic() < phase2_end:
        enqueue_iteration(manager, rng, 10, rank)
        time.sleep(0.005)
    (args.out / f"phase2_done{rank}").touch()

    alive = [r for r in range(size) if r != args.victim or args.how == "stall"]
    if rank == 0:
        if not wait_for(lambda: all((args.out / f"phase2_done{r}").exists() for r in alive), 30):
            fail(args.out, rank, "survivors did not finish phase 2")
        started = time.monotonic()
        manager.close()
        close_s = time.monotonic() - started
        if not reader.finished(30):
            fail(args.out, rank, "rank 0 reader did not finish")
        stats = manager.gather.stats()
        non_victim_arrivals = [t for t, r, _ in arrivals if r not in (0, args.victim)]
        write_result(
            args.out,
            rank,
            {
                "rank": rank,
                "close_s": close_s,
                "gather": dataclasses.asdict(stats),
                "received_ids": {str(r): ids for r, ids in ids_by_rank(got).items()},
                "victim_drops": victim_drops,
                "arrival_times_of_others": non_victim_arrivals,
                "enqueued": manager.stats().events_enqueued_total,
            },
        )
    else:
        if not manager.gather.join(timeout=30):
            fail(args.out, rank, "the gather did not stop after rank 0 closed")
        manager.close()
        write_result(
            args.out,
            rank,
            {
                "rank": rank,
                "enqueued": manager.stats().events_enqueued_total,
                "gather": dataclasses.asdict(manager.gather.stats()),
            },
        )
        # Stay until rank 0 is done: with a dead peer, hydra may end the job when one exits.
        wait_for(lambda: (args.out / "rank0.json").exists(), 60, 0.05)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
