"""Rebuilding the index from a real Kafka topic, and from a checkpoint: the bench/index.py child.

The topic holds the benchmark stream replicated to ``target_events`` (copy k renames every
instance id, as the in-memory rebuild does), produced once the way the sink produces (keyed by
instance, the sink's compression, idempotent) into a broker whose data persists between runs
(``$KVEVENTS_BENCH_BROKER_DIR``, default ``~/.cache/kvevents/bench-broker``; or the broker at
``$KAFKA_BOOTSTRAP_SERVERS``). A topic whose message count matches is reused; one that does not
(an interrupted run) is deleted and produced again.

Measured, each in this process:

- producing the topic (once): seconds, messages, bytes, disk used by its partitions;
- raw reads (no index) with several librdkafka fetch settings, to see what fetching costs;
- rebuild: ``EventReader.apply_to`` over the whole topic into a fresh ``CacheIndex``;
- checkpoint: an index caught up to all but the tail of the topic is checkpointed (file and
  compacted topic); restoring it and catching up the tail is timed, and the result compared
  with the full rebuild (``same_state``).
"""

from __future__ import annotations

import gc
import hashlib
import json
import os
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from confluent_kafka import Producer
from confluent_kafka.admin import AdminClient
from kvevents.consumer import (
    CacheIndex,
    Checkpoint,
    EventReader,
    KafkaCheckpointStore,
    load_checkpoint,
    restore,
    save_checkpoint,
)
from kvevents.producer.sink_config import DEFAULT_PRODUCER_CONFIG
from kvevents.schemas import current_fingerprint

PARTITIONS = 8
THROUGHPUT_JVM_OPTIONS = ("-XX:+UseParallelGC", "-XX:+ExitOnOutOfMemoryError", "-Djava.awt.headless=true")
"""The broker's JVM for this benchmark: C2 and a throughput collector (the default fast-start
flags, C1 only, favour a 1 s start over serving gigabytes)."""

LIBRDKAFKA_DEFAULTS = {
    "fetch.max.bytes": 52_428_800,
    "max.partition.fetch.bytes": 1_048_576,
    "queued.max.messages.kbytes": 65_536,
    "fetch.wait.max.ms": 500,
}
FETCH_SETTINGS = {
    "librdkafka defaults": LIBRDKAFKA_DEFAULTS,
    "kvevents defaults": {},  # EventReader's DEFAULT_CONSUMER_CONFIG
    "bigger": {
        "max.partition.fetch.bytes": 33_554_432,
        "fetch.max.bytes": 134_217_728,
        "queued.max.messages.kbytes": 1_048_576,
    },
}


def _varint(n: int) -> bytes:
    """Avro's zigzag varint of a long (here a string length)."""
    n = (n << 1) ^ (n >> 63)
    out = bytearray()
    while True:
        byte = n & 0x7F
        n >>= 7
        if n:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def instance_of(data: bytes) -> bytes:
    """The instance id of a single-object encoded batch (short ids: a one-byte length)."""
    return data[11 : 11 + (data[10] >> 1)]


def renamed_copy(encoded: list[bytes], k: int) -> list[bytes]:
    """Copy ``k`` of the stream: every instance id ends in ``-c<k>`` (copy 0 is the stream)."""
    if k == 0:
        return encoded
    copy = []
    for data in encoded:
        old_len = data[10] >> 1  # instance ids here are short: a one-byte length
        new_id = data[11 : 11 + old_len] + b"-c%d" % k
        copy.append(data[:10] + _varint(len(new_id)) + new_id + data[11 + old_len :])
    return copy


def replicated(encoded: list[bytes], copies: int) -> Iterator[bytes]:
    """The stream, then copies of it whose instance ids end in ``-c<k>``."""
    for k in range(copies):
        yield from renamed_copy(encoded, k)


def topic_name(config: Any, copies: int) -> str:
    key = json.dumps([config.__dict__, copies, current_fingerprint().hex()], sort_keys=True, default=str)
    return f"bench-index-{copies}x-{hashlib.sha1(key.encode()).hexdigest()[:12]}"


@contextmanager
def bench_broker(
    jvm_options: tuple[str, ...] = THROUGHPUT_JVM_OPTIONS,
) -> Iterator[tuple[str, dict[str, Any]]]:
    """The broker: ``$KAFKA_BOOTSTRAP_SERVERS``, else a local one whose data stays for next time
    (started with ``jvm_options``, or ``$KVEVENTS_BROKER_JVM_OPTS`` when set)."""
    env = os.environ.get("KAFKA_BOOTSTRAP_SERVERS")
    if env:
        yield env, {"source": "KAFKA_BOOTSTRAP_SERVERS"}
        return
    from kvevents.broker import LocalBroker

    state = Path(os.environ.get("KVEVENTS_BENCH_BROKER_DIR", "~/.cache/kvevents/bench-broker")).expanduser()
    options = os.environ.get("KVEVENTS_BROKER_JVM_OPTS")
    broker = LocalBroker(
        state, heap="1g", jvm_options=None if options is not None else jvm_options, stop_with_parent=True
    )
    broker.start()
    info = {
        "source": "local",
        "state_dir": str(state),
        "jvm_options": list(broker.jvm_options),
        "start_s": broker.last_start_seconds,
    }
    try:
        yield broker.bootstrap_servers, info
    finally:
        broker.stop()


def _topic_messages(bootstrap: str, topic: str) -> int | None:
    from kvevents.consumer.topics import TopicError, describe_topic

    try:
        return sum(p.messages for p in describe_topic(bootstrap, topic, timeout=20).partitions)
    except TopicError:
        return None


def _disk_bytes(state_dir: str | None, topic: str) -> int | None:
    if state_dir is None:
        return None
    total = 0
    for part in (Path(state_dir) / "data").glob(f"{topic}-*"):
        # allocated blocks, not sizes: Kafka preallocates sparse 10 MB index files per segment
        total += sum(f.stat().st_blocks * 512 for f in part.iterdir() if f.is_file())
    return total


def ensure_topic(
    bootstrap: str, topic: str, messages: list[bytes] | Iterator[bytes], expected: int, state_dir: str | None
) -> dict[str, Any]:
    """Produce the topic unless it already holds ``expected`` messages; what it took."""
    from kvevents.consumer.topics import TopicSpec, create_topic

    found = _topic_messages(bootstrap, topic)
    if found == expected:
        return {
            "produced_now": False,
            "messages": found,
            "disk_bytes": _disk_bytes(state_dir, topic),
            "when_produced": _production_log(state_dir).get(topic),
        }
    if found is not None:  # an interrupted earlier run: start over
        AdminClient({"bootstrap.servers": bootstrap}).delete_topics([topic])[topic].result(30)
        time.sleep(2)
    create_topic(
        bootstrap, TopicSpec(topic, partitions=PARTITIONS, retention_ms=-1, max_message_bytes=8 << 20)
    )
    producer = Producer(
        {
            "bootstrap.servers": bootstrap,
            "enable.idempotence": True,
            "acks": "all",
            "compression.type": DEFAULT_PRODUCER_CONFIG["compression.type"],
            "linger.ms": 20,
            "batch.size": 1_000_000,
            "queue.buffering.max.kbytes": 524_288,
            "partitioner": "murmur2_random",
            "message.max.bytes": 8 << 20,
        }
    )
    failures: list[str] = []

    def delivered(err: Any, _msg: Any) -> None:
        if err is not None:
            failures.append(str(err))

    start = time.perf_counter()
    count = nbytes = 0
    for data in messages:
        while True:
            try:
                producer.produce(topic, value=data, key=instance_of(data), on_delivery=delivered)
                break
            except BufferError:
                producer.poll(0.05)
        producer.poll(0)
        count += 1
        nbytes += len(data)
    left = producer.flush(300)
    seconds = time.perf_counter() - start
    if left or failures:
        raise SystemExit(f"producing {topic}: {left} undelivered, failures {failures[:3]}")
    assert _topic_messages(bootstrap, topic) == expected == count
    result = {
        "produced_now": True,
        "messages": count,
        "value_bytes": nbytes,
        "produce_s": seconds,
        "produce_mb_per_s": nbytes / seconds / 1e6,
        "disk_bytes": _disk_bytes(state_dir, topic),
        "produced_at": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    if state_dir is not None:  # what producing took, for the runs that reuse the topic
        log = _production_log(state_dir)
        log[topic] = result
        (Path(state_dir) / PRODUCTION_LOG).write_text(json.dumps(log, indent=1))
    return result


PRODUCTION_LOG = "bench-topics.json"


def _production_log(state_dir: str | None) -> dict[str, Any]:
    path = None if state_dir is None else Path(state_dir) / PRODUCTION_LOG
    if path is None or not path.exists():
        return {}
    return dict(json.loads(path.read_text()))


def raw_read(bootstrap: str, topic: str, config: dict[str, Any]) -> dict[str, Any]:
    """Read the whole topic without an index: what fetching and the reader loop cost."""
    gc.collect()
    start = time.perf_counter()
    count = nbytes = 0
    with EventReader(bootstrap, topic, config=config) as reader:
        for message in reader.messages(until_caught_up=True):
            count += 1
            nbytes += len(message.value())
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "messages": count, "mb_per_s": nbytes / seconds / 1e6}


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def rebuild(bootstrap: str, topic: str, config: dict[str, Any]) -> tuple[dict[str, Any], CacheIndex]:
    gc.collect()
    index = CacheIndex()
    start = time.perf_counter()
    cpu = time.process_time()
    with EventReader(bootstrap, topic, config=config) as reader:
        result = reader.apply_to(index)
    seconds = time.perf_counter() - start
    return {
        "seconds": seconds,
        "cpu_seconds": time.process_time() - cpu,
        "messages": result.messages,
        "events": result.events,
        "events_per_s": result.events / seconds,
        "mb_per_s": result.bytes / seconds / 1e6,
        "caught_up": result.caught_up,
        "workers": index.stats().workers,
        "held_worker_blocks": index.held_blocks(),
        "max_rss_bytes": rss_bytes(),
    }, index


def checkpoint_cycle(
    bootstrap: str, topic: str, full: CacheIndex, tail_messages: int, workdir: Path
) -> dict[str, Any]:
    """Checkpoint an index that lacks the topic's last ``tail_messages`` messages, then time
    restoring it (file, then compacted topic) and catching up the tail."""
    total = _topic_messages(bootstrap, topic) or 0
    behind = CacheIndex()
    with EventReader(bootstrap, topic) as reader:
        reader.apply_to(behind, max_messages=total - tail_messages)
        start = time.perf_counter()
        checkpoint = Checkpoint.capture(behind, reader)
        capture_s = time.perf_counter() - start
    del behind
    gc.collect()
    path = workdir / "bench.ckpt"
    start = time.perf_counter()
    file_bytes = save_checkpoint(path, checkpoint)
    save_file_s = time.perf_counter() - start
    store = KafkaCheckpointStore(bootstrap, f"{topic}-checkpoints", chunk_bytes=4 << 20)
    store.create_topic()
    start = time.perf_counter()
    saved = store.save(checkpoint)
    save_kafka_s = time.perf_counter() - start
    tail = total - checkpoint.messages
    del checkpoint
    gc.collect()
    out: dict[str, Any] = {
        "tail_messages": tail,
        "state_bytes": file_bytes,
        "capture_s": capture_s,
        "save_file_s": save_file_s,
        "save_kafka_s": save_kafka_s,
        "kafka_chunks": saved.chunks,
    }
    for source in ("file", "kafka"):
        gc.collect()
        start = time.perf_counter()
        loaded = load_checkpoint(path) if source == "file" else store.load()
        assert loaded is not None
        load_s = time.perf_counter() - start
        restored = restore(loaded, bootstrap)
        total_s = time.perf_counter() - start
        with restored.reader:
            caught = restored.caught_up
            assert caught is not None
            out[source] = {
                "seconds": total_s,
                "load_s": load_s,
                "restore_and_catch_up_s": total_s - load_s,
                "catch_up_s": caught.seconds,
                "tail_events": caught.events,
                "equals_full_rebuild": restored.index.same_state(full),
            }
        del restored, loaded
    return out


REBUILD_SETTINGS = ("kvevents defaults", "librdkafka defaults", "bigger")


def run(payload: dict[str, Any], config: Any, target_events: int, repeat: int) -> dict[str, Any]:
    from kvevents.broker import FAST_START_JVM_OPTIONS

    encoded: list[bytes] = payload["encoded"]
    per_copy = payload["events"]
    copies = -(-target_events // per_copy)
    topic = topic_name(config, copies)
    with bench_broker() as (bootstrap, broker_info):
        production = ensure_topic(
            bootstrap, topic, replicated(encoded, copies), copies * len(encoded), broker_info.get("state_dir")
        )
        del encoded, payload
        gc.collect()
        fetch = {name: raw_read(bootstrap, topic, settings) for name, settings in FETCH_SETTINGS.items()}
        runs: dict[str, list[dict[str, Any]]] = {name: [] for name in REBUILD_SETTINGS}
        full = None
        for _ in range(repeat):  # alternating settings, so that load from elsewhere hits all alike
            for name in REBUILD_SETTINGS:
                full = None
                row, full = rebuild(bootstrap, topic, FETCH_SETTINGS[name])
                runs[name].append(row)
        best = {name: min(rows, key=lambda r: r["seconds"]) for name, rows in runs.items()}
        assert full is not None
        with tempfile.TemporaryDirectory() as tmp:
            checkpoint = checkpoint_cycle(
                bootstrap, topic, full, tail_messages=max(1, production["messages"] // 100), workdir=Path(tmp)
            )
        del full
    jvm_compare = None
    if broker_info["source"] == "local" and os.environ.get("KVEVENTS_BROKER_JVM_OPTS") is None:
        gc.collect()
        with bench_broker(FAST_START_JVM_OPTIONS) as (bootstrap, fast_info):
            raw = raw_read(bootstrap, topic, {})
            row, _ = rebuild(bootstrap, topic, {})
        jvm_compare = {
            "jvm_options": fast_info["jvm_options"],
            "raw_read": raw,
            "rebuild": row,
            "throughput_jvm_raw_read_s": fetch["kvevents defaults"]["seconds"],
            "throughput_jvm_rebuild_s": best["kvevents defaults"]["seconds"],
        }
    main = best["kvevents defaults"]
    return {
        "rebuild_from_topic": {
            "topic": topic,
            "partitions": PARTITIONS,
            "broker": broker_info,
            "production": production,
            "events": main["events"],
            "seconds": main["seconds"],
            "events_per_s": main["events_per_s"],
            "cpu_seconds": main["cpu_seconds"],
            "max_rss_bytes": main["max_rss_bytes"],
            "target_s": 60.0,
            "runs": runs,
            "best_by_fetch_settings": {n: r["seconds"] for n, r in best.items()},
            "raw_fetch": fetch,
            "fetch_settings": FETCH_SETTINGS,
            "fast_start_jvm": jvm_compare,
            "status": "measured",
        },
        "rebuild_from_checkpoint": {**checkpoint, "target_s": 5.0, "status": "measured"},
    }
