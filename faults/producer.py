"""A fault case's engine: ``python -m faults.producer --out FILE ...`` drives a real
KVCacheEventManager and KafkaEventSink at a set rate and writes its figures as JSON.

Each iteration (1 ms) stores new one-block chains and removes old ones, so the index stays
small; every enqueue and flush call is timed (the engine thread's latency). Every 0.1 s it
samples the sink (delivered, queued, lost), with wall-clock times, so the orchestrator can
tell when delivery resumed after a fault. SIGTERM ends the run early, cleanly.
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import signal
import threading
import time
from pathlib import Path
from typing import Any

from kvevents.producer import BlockInfo, KafkaEventSink, KVCacheEventManager

TOKENS = tuple(range(16))
WINDOW = 4096


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--bootstrap", required=True)
    p.add_argument("--topic", required=True)
    p.add_argument("--instance", default="fault-0")
    p.add_argument("--rate", type=float, default=5000, help="events per second")
    p.add_argument("--duration", type=float, default=10)
    p.add_argument("--max-entries", type=int, default=100_000, help="max_kv_event_entries")
    p.add_argument("--max-queued-events", type=int, default=1_000_000)
    p.add_argument("--close-timeout", type=float, default=60)
    p.add_argument("--random-tokens", action="store_true", help="incompressible token ids (fills disks)")
    p.add_argument("-X", dest="config", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--out", type=Path, required=True)
    return p.parse_args(argv)


def run(args: argparse.Namespace) -> dict[str, Any]:
    stop = False

    def on_term(signum: int, frame: Any) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, on_term)
    config = {"bootstrap.servers": args.bootstrap}
    config.update(dict(item.split("=", 1) for item in args.config))
    manager = KVCacheEventManager(args.max_entries)
    sink = KafkaEventSink(
        manager, args.topic, args.instance, config=config, max_queued_events=args.max_queued_events
    )
    samples: list[tuple[float, int, int, int]] = []  # (wall time, delivered, queued, lost)
    sampling = threading.Event()

    def sample() -> None:  # also while the sink closes (delivering its backlog)
        while not sampling.wait(0.1):
            s = sink.stats()
            samples.append(
                (
                    time.time(),
                    s.events_delivered_total,
                    s.queued_events,
                    sum(s.events_lost_by_reason.values()),
                )
            )

    sampler = threading.Thread(target=sample, name="faults-sampler", daemon=True)
    sampler.start()
    enqueue_max_ns = 0
    slow_calls = 0  # calls over 1 ms
    next_hash = 1
    held: list[int] = []
    rng = random.Random(0)
    started = time.monotonic()
    owed = 0.0
    tick = 0.001
    deadline = started + args.duration
    now = started
    while not stop and now < deadline:
        owed += args.rate * tick
        for _ in range(int(owed)):
            if len(held) > 256:
                t0 = time.perf_counter_ns()
                manager.enqueue_removed_event(held.pop(0), WINDOW)
            else:
                tokens = tuple(rng.getrandbits(31) for _ in TOKENS) if args.random_tokens else TOKENS
                blocks = [BlockInfo(next_hash, None, tokens)]  # the engine's own work, not timed
                t0 = time.perf_counter_ns()
                manager.enqueue_stored_event(blocks, WINDOW)
                held.append(next_hash)
                next_hash += 1
            spent = time.perf_counter_ns() - t0
            enqueue_max_ns = max(enqueue_max_ns, spent)
            slow_calls += spent > 1_000_000
        owed -= int(owed)
        t0 = time.perf_counter_ns()
        manager.flush()
        spent = time.perf_counter_ns() - t0
        enqueue_max_ns = max(enqueue_max_ns, spent)
        slow_calls += spent > 1_000_000
        now = time.monotonic()
        time.sleep(max(0.0, tick - (time.monotonic() - now)))
        now = time.monotonic()
    produced_s = time.monotonic() - started
    manager.close()
    report = sink.close(timeout=args.close_timeout)
    sampling.set()
    sampler.join()
    s = sink.stats()
    m = manager.stats()
    return {
        "instance": args.instance,
        "produced": m.events_enqueued_total,
        "produce_seconds": produced_s,
        "manager_drops": m.events_dropped_total,
        "delivered": s.events_delivered_total,
        "lost_by_reason": dict(s.events_lost_by_reason),
        "drops_reported": sum(s.drops_reported_by_rank.values()),
        "undelivered": sum(report.undelivered_by_rank.values()),
        "unreported": sum(report.unreported_by_rank.values()),
        "messages_failed_by_error": dict(s.messages_failed_by_error),
        "errors_by_code": dict(s.errors_by_code),
        "close_seconds": report.seconds,
        "max_enqueue_us": enqueue_max_ns / 1000,
        "calls_over_1ms": slow_calls,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "samples": samples,
    }


def main() -> None:
    args = parse()
    result = run(args)
    args.out.write_text(json.dumps(result))


if __name__ == "__main__":
    main()
