"""Analytics benchmark: how fast ``kvevents export parquet`` turns a topic into Parquet, side by
side with ``kvevents tail > /dev/null`` (decode and print every event) on the same topic.

A topic is made once with ``mpiexec -n 4 kvevents simulate --instances 2 --no-realtime``; then
each command reads the whole topic from the beginning, alternating their order over
``--repeats`` rounds (a fresh export directory each time). Reported per command: wall-clock
seconds of the whole command (process start included) and events/s (the topic's events over
those seconds); for the export also the rows/s it measured itself (reading, decoding, building
columns and writing Parquet, start-up excluded). With ``--spark`` the Spark job
(``kvevents export spark``, local mode, ``--available-now``) runs once as well.

    python bench/analytics.py             # about a minute
    python bench/analytics.py --quick     # smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from e2e import kafka_broker, mpiexec
from kvevents.consumer import EventReader
from kvevents.consumer.topics import TopicSpec, create_topic
from kvevents.schemas import decode_batch

RESULTS = Path(__file__).resolve().parent / "results" / "analytics.json"
KVEVENTS = [sys.executable, "-m", "kvevents.cli"]


def make_topic(bootstrap: str, requests: int) -> str:
    topic = f"bench-analytics-{uuid.uuid4().hex[:8]}"
    create_topic(bootstrap, TopicSpec(topic, partitions=2))
    subprocess.run(
        [mpiexec(), "-n", "4", *KVEVENTS, "simulate", "--instances", "2", "--requests", str(requests),
         "--no-realtime", "-b", bootstrap, "-t", topic, "-q"],
        check=True, stdout=subprocess.DEVNULL,
    )  # fmt: skip
    return topic


def topic_size(bootstrap: str, topic: str) -> tuple[int, int, int]:
    """(messages, events, bytes) of the whole topic."""
    messages = events = size = 0
    with EventReader(bootstrap, topic) as reader:
        for message in reader.messages(until_caught_up=True):
            value = message.value()
            messages += 1
            size += len(value)
            events += len(decode_batch(value).events)
    return messages, events, size


def timed(command: list[str]) -> tuple[float, str]:
    started = time.perf_counter()
    done = subprocess.run(command, check=True, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    return time.perf_counter() - started, done.stdout


def run_tail(bootstrap: str, topic: str) -> dict[str, Any]:
    started = time.perf_counter()
    with open(os.devnull, "w") as devnull:
        subprocess.run(
            [*KVEVENTS, "tail", "-b", bootstrap, "-t", topic, "--from-beginning", "--no-follow", "-q"],
            check=True, stdout=devnull, stderr=subprocess.DEVNULL,
        )  # fmt: skip
    return {"seconds": time.perf_counter() - started}


def run_export(bootstrap: str, topic: str, work: Path) -> dict[str, Any]:
    out = work / f"export-{uuid.uuid4().hex[:6]}"
    seconds, stdout = timed(
        [*KVEVENTS, "export", "parquet", str(out), "-b", bootstrap, "-t", topic, "--json", "-q"]
    )
    summary = json.loads(stdout)
    size = sum(p.stat().st_size for p in out.rglob("*.parquet"))
    shutil.rmtree(out)
    return {
        "seconds": seconds,
        "rows": summary["rows"],
        "inner_rows_per_s": summary["rows_per_s"],
        "parquet_bytes": size,
    }


def run_spark(bootstrap: str, topic: str, work: Path) -> dict[str, Any]:
    out = work / "spark-export"
    seconds, stdout = timed(
        [*KVEVENTS, "export", "spark", str(out), "-b", bootstrap, "-t", topic, "--json", "-q"]
    )
    summary = json.loads(stdout)
    return {"seconds": seconds, "job_seconds": summary["seconds"], "messages": summary["messages"]}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--requests", type=int, default=2500, help="requests per simulated rank (default 2500)"
    )
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="300 requests per rank, one round")
    parser.add_argument(
        "--spark", action="store_true", help="also run the Spark job once (needs the spark extra)"
    )
    args = parser.parse_args()
    if args.quick:
        args.requests, args.repeats = 300, 1
    with kafka_broker() as (bootstrap, broker), tempfile.TemporaryDirectory(prefix="bench-analytics-") as tmp:
        work = Path(tmp)
        topic = make_topic(bootstrap, args.requests)
        messages, events, size = topic_size(bootstrap, topic)
        runs: dict[str, list[dict[str, Any]]] = {"tail": [], "export_parquet": []}
        for i in range(args.repeats):
            order = ["tail", "export_parquet"] if i % 2 == 0 else ["export_parquet", "tail"]
            for name in order:
                result = run_tail(bootstrap, topic) if name == "tail" else run_export(bootstrap, topic, work)
                runs[name].append(result)
        if args.spark:
            runs["spark"] = [run_spark(bootstrap, topic, work)]

    def best(name: str) -> dict[str, Any]:
        return min(runs[name], key=lambda r: r["seconds"])

    rows = []
    for name in runs:
        b = best(name)
        rows.append(
            {
                "command": name,
                "seconds": round(b["seconds"], 3),
                "events_per_s": round(events / b["seconds"]),
                **{k: v for k, v in b.items() if k != "seconds"},
            }
        )
    tail_s = best("tail")["seconds"]
    print(f"topic {topic}: {messages:,} messages, {events:,} events, {size / 1e6:.1f} MB ({broker})")
    print(f"{'command':<16} {'seconds':>8} {'events/s':>10} {'vs tail':>8}  notes")
    for r in rows:
        notes = ""
        if "job_seconds" in r:
            notes = f"job alone (Spark started) {r['job_seconds']:.1f} s = {events / r['job_seconds']:,.0f} events/s"
        if "inner_rows_per_s" in r:
            notes = f"{r['rows']:,} rows, {r['inner_rows_per_s']:,} rows/s inside, {r['parquet_bytes'] / 1e6:.1f} MB Parquet"
        print(
            f"{r['command']:<16} {r['seconds']:>8.2f} {r['events_per_s']:>10,} {tail_s / r['seconds']:>7.2f}x  {notes}"
        )
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(
        json.dumps(
            {
                "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
                "topic": {"messages": messages, "events": events, "bytes": size, "broker": broker},
                "results": rows,
                "runs": runs,
                "speed_vs_tail": {r["command"]: round(tail_s / r["seconds"], 3) for r in rows},
            },
            indent=1,
        )
        + "\n"
    )
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
