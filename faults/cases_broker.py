"""Faults of the broker side: a broker SIGKILLed mid-stream and restarted; a full log disk."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
import uuid
from pathlib import Path
from typing import Any

from kvevents.consumer.topics import TopicSpec, create_topic

from .audit import TopicAudit, audit_topic
from .procs import Producer, first_delivery_after, own_broker, sigkill_broker, wait_for_value, wait_until
from .report import FaultResult


def fill_from(result: FaultResult, produced: dict[str, Any], audit: TopicAudit) -> None:
    """The common columns from the producer's figures and the topic read back."""
    counted = produced["manager_drops"] + sum(produced["lost_by_reason"].values())
    result.produced = produced["produced"]
    result.delivered = audit.distinct_events
    result.dropped_counted = counted
    result.unaccounted = result.produced - result.delivered - counted
    result.duplicated = audit.duplicated
    result.duplicated_after_dedup = audit.duplicated_after_dedup
    result.max_enqueue_us = round(produced["max_enqueue_us"], 1)
    result.peak_rss_mb = round(produced["peak_rss_mb"], 1)
    result.details.update(
        producer={k: v for k, v in produced.items() if k != "samples"},
        topic={
            "messages": audit.messages,
            "events": audit.events,
            "distinct_events": audit.distinct_events,
            "dropped_in_band": audit.dropped_in_band,
            "malformed": audit.malformed,
            "index_events_applied": audit.index_events_applied,
            "index_events_duplicate": audit.index_events_duplicate,
            "degraded": [f"{k.instance_id}/{k.attention_dp_rank}" for k in audit.degraded],
        },
    )
    result.ok = (
        result.unaccounted == 0
        and result.duplicated_after_dedup == 0
        and produced["unreported"] == 0
        and audit.dropped_in_band >= counted  # every counted loss reached consumers in-band
        and (counted == 0) == (not audit.degraded)  # degraded exactly when something was lost
    )


def broker_sigkill(work: Path, quick: bool) -> FaultResult:
    """The only broker SIGKILLed mid-stream, restarted after a pause; the producer keeps going."""
    result = FaultResult("broker SIGKILL + restart")
    rate, duration = (5000, 8.0) if quick else (10000, 20.0)
    kill_at, down_s = duration * 0.3, duration * 0.2
    broker = own_broker(work / "broker")
    try:
        bootstrap = broker.bootstrap_servers
        topic = f"faults-broker-kill-{uuid.uuid4().hex[:8]}"
        create_topic(bootstrap, TopicSpec(topic, partitions=1))
        producer = Producer(work / "producer.json", bootstrap, topic, rate=rate, duration=duration)
        time.sleep(kill_at)
        sigkill_broker(broker)
        killed_at = time.time()
        time.sleep(down_s)
        broker.start()
        back_at = time.time()
        produced = producer.result(timeout=duration + 120)
        audit = audit_topic(bootstrap, topic)
    finally:
        broker.stop(timeout=10)
    fill_from(result, produced, audit)
    resumed = first_delivery_after(produced["samples"], back_at)
    result.recover_s = None if resumed is None else round(resumed, 2)
    result.details.update(
        killed_at=killed_at, broker_back_at=back_at, broker_down_s=round(back_at - killed_at, 2)
    )
    result.happened = (
        f"broker down {back_at - killed_at:.1f} s; the sink queued meanwhile "
        f"(engine thread never blocked), delivery resumed {result.recover_s} s after the restart; "
        f"{result.duplicated} events written twice by retries, none applied twice"
    )
    return result


def disk_full(work: Path, quick: bool) -> FaultResult:
    """The broker's log volume fills up mid-stream, then space returns.

    The volume is a small tmpfs mounted for the case (root only; otherwise the case says so
    and stops), almost filled by a ballast file: the producer's data fills the rest. Kafka
    takes a full log directory offline and, its only one gone, the broker shuts down; the
    producer's sink keeps the events (bounded, drops counted). Then the ballast is deleted and
    the broker restarted: every event must be delivered or counted, none applied twice.
    """
    result = FaultResult("broker disk full")
    if os.geteuid() != 0:
        result.happened = "skipped: mounting the small log volume (tmpfs) needs root"
        result.error = "not root"
        return result
    volume = work / "log-volume"
    volume.mkdir()
    size_mb, free_mb = 64, 3
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_mb}m", "tmpfs", str(volume)], check=True)
    duration = 20.0 if quick else 40.0
    try:
        broker = own_broker(
            work / "broker",
            # Topic data on the small volume; the cluster metadata stays on the state dir's disk.
            **{
                "log.dirs": str(volume / "kafka"),
                "metadata.log.dir": str(work / "broker" / "data"),
                "log.segment.bytes": str(1 << 20),
            },
        )
        try:
            bootstrap = broker.bootstrap_servers
            topic = f"faults-disk-full-{uuid.uuid4().hex[:8]}"
            create_topic(bootstrap, TopicSpec(topic, partitions=1))
            ballast = volume / "ballast"
            free = shutil.disk_usage(volume).free
            with open(ballast, "wb") as f:
                f.write(b"\0" * max(0, free - free_mb * 2**20))
            producer = Producer(
                work / "producer.json", bootstrap, topic, rate=20000, duration=duration, random_tokens="",
                max_queued_events=200_000,
            )  # fmt: skip
            pid = broker.status().pid
            went_down = wait_until(
                lambda: pid is None or not Path(f"/proc/{pid}").exists() or broker.status().pid is None,
                duration,
                "the broker to stop on the full disk",
            )
            full_at = time.time()
            ballast.unlink()
            time.sleep(1.0)
            broker.start()
            back_at = time.time()
            produced = producer.result(timeout=duration + 180)
            audit = audit_topic(bootstrap, topic)
        finally:
            broker.stop(timeout=10)
    finally:
        subprocess.run(["umount", "-l", str(volume)], check=False)
    fill_from(result, produced, audit)
    resumed = first_delivery_after(produced["samples"], back_at)
    result.recover_s = None if resumed is None else round(resumed, 2)
    errors = produced["errors_by_code"]
    result.details.update(
        volume_mb=size_mb, free_mb_at_start=free_mb, broker_down_after_s=round(went_down, 1),
        space_back_at=full_at, broker_back_at=back_at, volume="tmpfs",
    )  # fmt: skip
    result.happened = (
        f"the {free_mb} MB left on the log volume filled in {went_down:.1f} s and the broker shut down (its only "
        f"log dir offline); producer errors counted {errors}; space freed and broker restarted, delivery resumed "
        f"{result.recover_s} s later; {result.dropped_counted:,} events counted as dropped, "
        f"{result.unaccounted} unaccounted"
    )
    return result


def leader_kill(work: Path, quick: bool) -> FaultResult:
    """A 3-node KRaft cluster (``kvevents broker start --nodes 3``); the leader of the topic's
    partition (replication factor 3, ``min.insync.replicas`` 2) SIGKILLed mid-stream."""
    from confluent_kafka import KafkaException
    from confluent_kafka.admin import AdminClient

    from kvevents.broker.cluster import LocalCluster

    result = FaultResult("partition leader SIGKILL (3 brokers)")
    rate, duration = (5000, 10.0) if quick else (10000, 20.0)
    cluster = LocalCluster(work / "cluster", 3, stop_with_parent=True)
    cluster.start()
    try:
        bootstrap = cluster.bootstrap_servers
        topic = f"faults-leader-kill-{uuid.uuid4().hex[:8]}"
        create_topic(bootstrap, TopicSpec(topic, partitions=1, replication_factor=3))
        admin = AdminClient({"bootstrap.servers": bootstrap, "log_level": 0})

        def leader() -> int:
            """The partition's leader, or -1 while metadata cannot be had (the admin client's
            connection may be to the node just killed: a metadata timeout is not a failure)."""
            try:
                return int(admin.list_topics(topic, timeout=5).topics[topic].partitions[0].leader)
            except KafkaException:
                return -1

        producer = Producer(work / "producer.json", bootstrap, topic, rate=rate, duration=duration)
        time.sleep(duration * 0.3)
        old, _ = wait_for_value(leader, lambda node: node != -1, 30, "the partition's leader")
        sigkill_broker(cluster.node(old))
        killed_at = time.time()
        new, failover = wait_for_value(
            leader, lambda node: node not in (old, -1), 60, "a new partition leader"
        )
        produced = producer.result(timeout=duration + 120)
        audit = audit_topic(bootstrap, topic)
    finally:
        cluster.stop(timeout=10)
    fill_from(result, produced, audit)
    resumed = first_delivery_after(produced["samples"], killed_at)
    result.recover_s = None if resumed is None else round(resumed, 2)
    result.details.update(old_leader=old, new_leader=new, leader_elected_after_s=round(failover, 2))
    result.happened = (
        f"leader node {old} SIGKILLed; node {new} led the partition {failover:.1f} s later (metadata seen); "
        f"deliveries resumed {result.recover_s} s after the kill; acks=all + idempotence: "
        f"{result.duplicated} events written twice, none applied twice, {result.unaccounted} lost uncounted"
    )
    return result
