"""Faults of the pipeline's processes: a rank SIGKILLed under mpiexec, a consumer SIGKILLed
mid-rebuild, 10x overload, the hostile-message corpus."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from datetime import datetime
from pathlib import Path

from confluent_kafka import Consumer, TopicPartition
from confluent_kafka import Producer as RawProducer
from kvevents.consumer import CacheIndex, load_checkpoint
from kvevents.consumer.topics import TopicSpec, create_topic
from kvevents.producer import find_mpiexec
from kvevents.producer.rank_guard import guarded_rank_pids

from .audit import audit_topic
from .cases_broker import fill_from
from .hostile import corpus
from .procs import REPO, Producer, default_client_quota, delivered_all_after, own_broker, wait_until
from .report import FaultResult


def _topic(bootstrap: str, stem: str, partitions: int = 1) -> str:
    name = f"faults-{stem}-{uuid.uuid4().hex[:8]}"
    create_topic(bootstrap, TopicSpec(name, partitions=partitions))
    return name


def rank_sigkill(work: Path, quick: bool) -> FaultResult:
    """``mpiexec -disable-auto-cleanup -n 4 kvevents simulate``; rank 2's process SIGKILLed."""
    result = FaultResult("rank SIGKILL under mpiexec")
    duration, victim = (8.0, 2) if quick else (20.0, 2)
    mpiexec = find_mpiexec()
    if mpiexec is None:
        raise RuntimeError("mpiexec not found: pip install -e '.[dev]'")
    broker = own_broker(work / "broker")
    try:
        bootstrap = broker.bootstrap_servers
        topic = _topic(bootstrap, "rank-kill")
        prefix = f"fr{uuid.uuid4().hex[:6]}"
        command = [
            mpiexec, "-disable-auto-cleanup", "-n", "4", sys.executable, "-m", "kvevents.cli", "simulate",
            "--instance-prefix", prefix, "--duration", str(duration), "--rate", "40", "--rank-timeout", "1",
            "-b", bootstrap, "--topic", topic, "--json",
        ]  # fmt: skip
        env = {k: v for k, v in os.environ.items() if k != "KVEVENTS_RANK_GUARD_PID"}
        proc = subprocess.Popen(
            command,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            start_new_session=True,
        )
        try:
            pids: dict[int, int] = {}

            def victim_started() -> bool:
                pids.update(guarded_rank_pids(f"\0{prefix}\0"))
                return victim in pids

            wait_until(victim_started, 60, f"rank {victim}'s process")
            time.sleep(duration * 0.35)
            os.kill(pids[victim], signal.SIGKILL)
            killed_at = time.time()
            stdout, stderr = proc.communicate(timeout=duration + 120)
        except BaseException:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            raise
        summary = json.loads(stdout)
        audit = audit_topic(bootstrap, topic)
    finally:
        broker.stop(timeout=10)
    survivors = [r for r in summary["per_rank"] if r["attention_dp_rank"] != victim]
    kafka = next(r["kafka"] for r in summary["per_rank"] if r["attention_dp_rank"] == 0)
    victim_delivered = kafka["events_delivered_by_rank"].get(str(victim), 0)
    produced_survivors = sum(r["events_enqueued"] for r in survivors)
    delivered_survivors = sum(
        kafka["events_delivered_by_rank"].get(str(r["attention_dp_rank"]), 0) for r in survivors
    )
    result.produced = produced_survivors + victim_delivered  # the victim's own count died with it
    result.delivered = audit.distinct_events
    result.dropped_counted = summary["drops"]
    result.unaccounted = produced_survivors - delivered_survivors  # survivors: every event
    result.duplicated = audit.duplicated
    result.duplicated_after_dedup = audit.duplicated_after_dedup
    detected = _log_time(stderr, "declared dead")
    result.recover_s = None if detected is None else round(detected - killed_at, 2)
    degraded = sorted(f"{k.instance_id}/{k.attention_dp_rank}" for k in audit.degraded)
    result.ok = (
        proc.returncode == 128 + signal.SIGKILL
        and result.unaccounted == 0
        and result.duplicated_after_dedup == 0
        and degraded == [f"{prefix}-0/{victim}"]
        and summary["events_lost_unreported"] == 0
        and summary["seconds"] >= duration
    )
    result.details.update(
        exit_code=proc.returncode,
        failed_ranks=summary["failed_ranks"],
        degraded=degraded,
        victim_events_delivered_before_death=victim_delivered,
        survivors_enqueued=produced_survivors,
        survivors_delivered=delivered_survivors,
    )
    result.happened = (
        f"rank {victim} declared dead {result.recover_s} s after the kill; ranks 0,1,3 produced to the end "
        f"({duration:.0f} s), all their events delivered; the dead rank's loss reported in-band "
        f"(1 event, a lower bound): index degraded {degraded}; mpiexec exit {proc.returncode}"
    )
    return result


def _log_time(stderr: str, marker: str) -> float | None:
    for line in stderr.splitlines():
        if marker in line:
            try:
                return datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()
            except ValueError:
                return None
    return None


def consumer_sigkill(work: Path, quick: bool) -> FaultResult:
    """``kvevents index --tail`` checkpointing every second, SIGKILLed while it catches up with
    a live producer; restarted from its checkpoint, it must equal a full replay."""
    result = FaultResult("consumer SIGKILL + checkpoint restart")
    rate, duration = (20000, 8.0) if quick else (20000, 20.0)
    broker = own_broker(work / "broker")
    try:
        bootstrap = broker.bootstrap_servers
        topic = _topic(bootstrap, "consumer-kill", partitions=2)
        producer = Producer(work / "producer.json", bootstrap, topic, rate=rate, duration=duration)
        checkpoint = work / "index.ckpt"
        base = [sys.executable, "-m", "kvevents.cli", "index", "-b", bootstrap, "-t", topic, "-q", "--json"]
        first = subprocess.Popen(
            [*base, "--tail", "--checkpoint", str(checkpoint), "--save-checkpoint", str(checkpoint),
             "--checkpoint-interval", "1"],
            cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
        )  # fmt: skip
        try:
            wait_until(checkpoint.exists, 60, "the consumer's first checkpoint")
            time.sleep(duration * 0.3)
            first.kill()
            first.wait()
            killed_at = time.time()
        finally:
            if first.poll() is None:
                first.kill()
        produced = producer.result(timeout=duration + 60)
        saved = load_checkpoint(checkpoint)
        restarted = time.monotonic()
        second = subprocess.run(
            [*base, "--checkpoint", str(checkpoint), "--save-checkpoint", str(work / "after.ckpt")],
            cwd=REPO, capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        recover = time.monotonic() - restarted
        if second.returncode != 0:
            raise RuntimeError(f"the restarted consumer exited {second.returncode}: {second.stderr[-2000:]}")
        after = load_checkpoint(work / "after.ckpt")
        # The full replay by the same command, from the topic's start: it applies the same rules
        # (a producer's clean close makes its workers leave the index), so the two must be equal.
        replay = subprocess.run(
            [*base, "--save-checkpoint", str(work / "full.ckpt")],
            cwd=REPO, capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        if replay.returncode != 0:
            raise RuntimeError(f"the full replay exited {replay.returncode}: {replay.stderr[-2000:]}")
        full = CacheIndex.from_bytes(load_checkpoint(work / "full.ckpt").index_state)
        audit = audit_topic(bootstrap, topic)
    finally:
        broker.stop(timeout=10)
    fill_from(result, produced, audit)
    equal = CacheIndex.from_bytes(after.index_state).same_state(full)
    result.recover_s = round(recover, 2)
    result.ok = result.ok and equal
    result.details.update(
        killed_at=killed_at, restored_equals_full_replay=equal, checkpoint_offsets=saved.offsets
    )
    result.happened = (
        f"consumer SIGKILLed while following; restarted from its last checkpoint it caught up in "
        f"{recover:.1f} s (process start included) and {'EQUALS' if equal else 'DIFFERS FROM'} a full replay"
    )
    return result


def overload(work: Path, quick: bool) -> FaultResult:
    """Ten times more events than Kafka takes: a broker quota throttles the producer to ~1/10
    of the offered rate for the whole run, then is lifted. Bounded buffers overflow, oldest
    first; every lost event must be counted and reported in-band, and the engine thread must
    not block."""
    result = FaultResult("10x overload")
    duration = 15.0 if quick else 60.0
    rate = 20_000
    broker = own_broker(work / "broker")
    try:
        bootstrap = broker.bootstrap_servers
        topic = _topic(bootstrap, "overload")
        default_client_quota(bootstrap, QUOTA_BYTES_PER_S)
        producer = Producer(
            work / "producer.json", bootstrap, topic, rate=rate, duration=duration,
            max_entries=10_000, max_queued_events=50_000, close_timeout=120,
            config=["queue.buffering.max.messages=100", "queue.buffering.max.kbytes=1024"],
        )  # fmt: skip
        time.sleep(duration)
        default_client_quota(bootstrap, None)
        lifted_at = time.time()
        produced = producer.result(timeout=240)
        audit = audit_topic(bootstrap, topic)
    finally:
        broker.stop(timeout=10)
    fill_from(result, produced, audit)
    throttled = [s for s in produced["samples"] if s[0] < lifted_at]
    carried = (
        (throttled[-1][1] - throttled[0][1]) / max(1e-9, throttled[-1][0] - throttled[0][0])
        if len(throttled) > 1
        else 0.0
    )
    offered = produced["produced"] / produced["produce_seconds"]
    drained = delivered_all_after(produced["samples"], lifted_at)
    result.recover_s = None if drained is None else round(drained, 2)
    result.details.update(
        offered_events_per_s=round(offered), carried_events_per_s=round(carried),
        overload_factor=round(offered / carried, 1) if carried else None, quota_bytes_per_s=QUOTA_BYTES_PER_S,
    )  # fmt: skip
    result.ok = result.ok and bool(carried) and offered / carried >= 5
    result.happened = (
        f"{offered:,.0f} events/s offered for {duration:.0f} s, Kafka took {carried:,.0f}/s "
        f"({offered / carried if carried else 0:.1f}x); {result.dropped_counted:,} dropped oldest-first and counted "
        f"(sink {sum(produced['lost_by_reason'].values()):,}, manager {produced['manager_drops']:,}), all reported "
        f"in-band; the backlog was delivered {result.recover_s} s after the quota was lifted"
    )
    return result


QUOTA_BYTES_PER_S = 2_000
"""The overload case's producer byte-rate quota: about a tenth of what its producer offers."""


def hostile_corpus(work: Path, quick: bool) -> FaultResult:
    """The hostile messages between two valid ones; a reader with a dead-letter topic."""
    result = FaultResult("hostile-message corpus")
    limit_s = 60.0 if quick else 180.0
    messages = corpus()
    broker = own_broker(work / "broker")
    try:
        bootstrap = broker.bootstrap_servers
        topic = _topic(bootstrap, "hostile")
        dead = _topic(bootstrap, "hostile-dlq")
        raw = RawProducer({"bootstrap.servers": bootstrap, "message.max.bytes": 4_000_000})
        from kvevents.schemas import EventBatch, KVCacheEvent, KVCacheRemovedData, encode_batch

        def good(seq: int) -> bytes:
            return encode_batch(
                EventBatch(
                    "good-0", [KVCacheEvent(seq, KVCacheRemovedData([9]), 64)], sequence=seq, producer_id=5
                )
            )

        raw.produce(topic, good(0), key=b"good-0")
        for name, value in messages.items():
            raw.produce(topic, value, key=name.encode())
        raw.produce(topic, good(1), key=b"good-0")
        if raw.flush(30):
            raise RuntimeError("could not write the corpus")
        del raw  # no reconnect attempts after the broker stops
        out = work / "reader.json"
        started = time.monotonic()
        reader = subprocess.Popen(
            [sys.executable, "-m", "faults.hostile", "--bootstrap", bootstrap, "--topic", topic,
             "--dead-letter", dead, "--out", str(out)],
            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
        )  # fmt: skip
        peak_kb = 0
        while reader.poll() is None and time.monotonic() - started < limit_s:
            peak_kb = max(peak_kb, _rss_kb(reader.pid))
            time.sleep(0.2)
        timed_out = reader.poll() is None
        if timed_out:
            reader.kill()
        log = reader.communicate()[0]
        seconds = time.monotonic() - started
        dead_letters = _count(bootstrap, dead)
    finally:
        broker.stop(timeout=10)
    result.produced = len(messages) + 2
    result.peak_rss_mb = round(peak_kb / 1024, 1)
    result.recover_s = round(seconds, 2)
    if timed_out or not out.exists():
        result.happened = (
            f"the reader did not get through {len(messages)} hostile messages in {limit_s:.0f} s "
            f"(peak {peak_kb / 1024:,.0f} MB) and was killed: the index cores need item 1's limits"
        )
        result.details.update(reader_output=log[-2000:], timed_out=timed_out)
        return result
    read = json.loads(out.read_text())
    result.delivered = read["messages"] - read["malformed"]
    result.dropped_counted = read["malformed"]
    result.details.update(reader=read, dead_letters=dead_letters, corpus=sorted(messages))
    accepted = result.produced - read["malformed"]
    result.ok = read["malformed"] == dead_letters and read["workers"] <= 16 and not timed_out
    result.happened = (
        f"{read['malformed']} of {len(messages)} hostile messages set aside and dead-lettered ({dead_letters}); "
        f"{accepted - 2} accepted as valid; index has {read['workers']:,} workers "
        f"({read['degraded']:,} degraded) after {read['seconds']:.1f} s, peak {result.peak_rss_mb:,.0f} MB"
    )
    return result


def _rss_kb(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def _count(bootstrap: str, topic: str) -> int:
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": f"faults-{uuid.uuid4().hex}"})
    try:
        low, high = consumer.get_watermark_offsets(TopicPartition(topic, 0), timeout=10)
    finally:
        consumer.close()
    return int(high - low)
