"""Faults of the broker side: a broker SIGKILLed mid-stream and restarted; a full log disk."""

from __future__ import annotations

import time
import uuid
from pathlib import Path
from typing import Any

from kvevents.consumer.topics import TopicSpec, create_topic

from .audit import TopicAudit, audit_topic
from .procs import Producer, first_delivery_after, own_broker, sigkill_broker
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
