"""How long the local Kafka broker takes to (re)start, per JVM profile, side by side.

Profiles, interleaved round by round so that machine noise hits them alike:
- ``plain``: the JVM's defaults (C2, G1), no class-data archive;
- ``fast-flags``: ``FAST_START_JVM_OPTIONS`` (C1 only, serial GC), no archive;
- ``fast-flags+cds``: those flags plus the class-data archive (what ``LocalBroker`` does).

Each start is timed until the broker answers a metadata request (a restart of a formatted data
directory, jars cached). Prints a table; writes ``bench/results/broker_start.json``.
Run: ``.venv/bin/python bench/broker_start.py [--rounds N]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from kvevents.broker import FAST_START_JVM_OPTIONS, LocalBroker
from kvevents.broker.jars import ensure_kafka_jars

PROFILES: dict[str, dict[str, object]] = {
    "plain": {"jvm_options": (), "class_data_sharing": False},
    "fast-flags": {"jvm_options": FAST_START_JVM_OPTIONS, "class_data_sharing": False},
    "fast-flags+cds": {"jvm_options": FAST_START_JVM_OPTIONS, "class_data_sharing": True},
}
RESULTS = Path(__file__).with_name("results") / "broker_start.json"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=3, help="timed restarts per profile (default: 3)")
    args = parser.parse_args()

    fetch_started = time.monotonic()
    dist = ensure_kafka_jars()
    fetch_seconds = time.monotonic() - fetch_started
    with tempfile.TemporaryDirectory(prefix="kvevents-bench-broker-") as tmp:
        brokers = {
            name: LocalBroker(Path(tmp) / name, stop_with_parent=True, **options)  # type: ignore[arg-type]
            for name, options in PROFILES.items()
        }
        first_start: dict[str, float] = {}
        for name, broker in brokers.items():  # formats the storage; dumps the archive if missing
            started = time.monotonic()
            broker.start()
            first_start[name] = time.monotonic() - started
            broker.stop()
        restarts: dict[str, list[float]] = {name: [] for name in brokers}
        stops: dict[str, list[float]] = {name: [] for name in brokers}
        for _ in range(args.rounds):
            for name, broker in brokers.items():
                started = time.monotonic()
                broker.start()
                restarts[name].append(time.monotonic() - started)
                stops[name].append(broker.stop().seconds)

    report = {
        "kafka_version": dist.version,
        "jar_fetch_seconds": round(fetch_seconds, 3),
        "jars_fetched_now": dist.fetched_now,
        "rounds": args.rounds,
        "profiles": {
            name: {
                "first_start_s": round(first_start[name], 3),
                "restart_median_s": round(statistics.median(restarts[name]), 3),
                "restart_best_s": round(min(restarts[name]), 3),
                "stop_median_s": round(statistics.median(stops[name]), 3),
            }
            for name in brokers
        },
    }
    baseline = report["profiles"]["plain"]["restart_median_s"]
    print(
        f"Kafka {dist.version}; jars {'fetched' if dist.fetched_now else 'cached'} in {fetch_seconds:.2f} s"
    )
    print(
        f"{'profile':<16} {'first start':>12} {'restart med':>12} {'restart best':>13} {'vs plain':>9} {'stop med':>9}"
    )
    for name, row in report["profiles"].items():
        ratio = row["restart_median_s"] / baseline
        print(
            f"{name:<16} {row['first_start_s']:>11.2f}s {row['restart_median_s']:>11.2f}s "
            f"{row['restart_best_s']:>12.2f}s {ratio:>8.2f}x {row['stop_median_s']:>8.2f}s"
        )
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
