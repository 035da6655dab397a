"""Benchmark of ``kvevents export``: how fast the topic is republished for routers, and how late.

- Stream: what the e2e benchmark's pipeline carries (the engine simulator at e2e's drop-free
  request rate, 2 instances x 4 ranks, offload to a secondary level: mostly single-block Stored,
  Removed and Updated events, ~73 bytes/event), made in-process and produced to a fresh topic
  (the sink's compression, keyed by instance). Events/s are in the same unit as e2e's.
- Throughput, each from the beginning of the topic until caught up, wall clock of the whole read:
  Kafka read + decode alone (the floor), ``export zmq`` (tagged maps and positional; a SUB in
  another process counts what arrives), ``export dynamo`` (RouterEvent JSON lines to /dev/null).
  Events/s counts kvevents events consumed (the pipeline's unit).
- Latency, Kafka -> subscriber: the exporter follows the topic live while batches are produced at
  a steady rate; a SUB in another process takes ``receive time - batch ts`` (the ts is set just
  before the batch is produced), so it covers produce, broker, fetch, convert and ZMQ.
- Each throughput case runs ``--repeat`` times, interleaved; the run with the best events per
  CPU-second is kept (all repeats are in the JSON). Events per CPU-second (the exporter
  process's CPU, librdkafka's and ZMQ's threads included) are the figure to read on a loaded
  machine; wall-clock events/s are printed beside them.
- Baseline, measured in the same run: the e2e benchmark's drop-free search (``bench/e2e.py``'s
  ``run_step``: ``mpiexec -n 4 kvevents simulate`` -> Kafka -> a live ``CacheIndex``, stepping
  the request rate up until drops, a lost event or a simulator that cannot keep pace; shorter
  steps than e2e's own run). Its highest drop-free events/s is the pipeline's rate; goal: every
  export >= 2x it, wall clock and per CPU-second, so the exporter is never the bottleneck. The
  figure in ``results/e2e.json`` (another run, another time) and the bridge's ingest rate
  (``results/bridge.json``) are printed beside it for reference.

Needs a broker: ``$KAFKA_BOOTSTRAP_SERVERS``, else a local one for the run. Results:
``results/export.json``. Default run about 1.5 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from kvevents.consumer import EventReader
from kvevents.consumer.export import relaxed_gc
from kvevents.schemas import EventBatch, decode_batch, encode_batch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from e2e import drop_free_steps, kafka_broker

RESULTS = Path(__file__).resolve().parent / "results"
E2E_RATES = (320.0, 640.0, 960.0, 1280.0)
"""Requests/s per rank of the drop-free search (e2e's own run steps 10..1280 by doubling)."""
DONE = b"__bench_done__"


def simulated_batches(
    target: int, instances: int = 2, ranks: int = 4, rate: float = 640.0, iterations_per_batch: int = 32
) -> list[EventBatch]:
    """The e2e benchmark's kind of stream (its engine simulator and workload at its drop-free
    request rate per rank), made in-process: one batch per instance every
    ``iterations_per_batch`` iterations, until ``target`` events."""
    from kvevents.producer import KVCacheEventManager
    from kvevents.producer.simulator import EngineSimulator, SimulatorConfig
    from kvevents.producer.simulator.workload import WorkloadConfig, WorkloadGenerator

    workload = WorkloadConfig(request_rate=rate)
    managers: dict[str, list[KVCacheEventManager]] = {}
    simulators: list[EngineSimulator] = []
    for i in range(instances):
        name = f"sim-{i}"
        managers[name] = []
        for rank in range(ranks):
            manager = KVCacheEventManager(
                1_000_000, attention_dp_rank=rank, attention_dp_size=ranks, attention_dp_gather=False
            )
            config = SimulatorConfig(
                instance_id=name,
                attention_dp_rank=rank,
                iterations_per_second=10 * rate,  # as bench/e2e.py sizes the engine for a rate
                num_secondary_blocks=256,  # offload, so there are tier moves
            )
            simulators.append(
                EngineSimulator(config, manager, WorkloadGenerator(workload.for_worker(name, rank)))
            )
            managers[name].append(manager)
    batches: list[EventBatch] = []
    sequence = dict.fromkeys(managers, 0)
    total = 0
    try:
        while total < target:
            for _ in range(iterations_per_batch):
                for simulator in simulators:
                    simulator.step()
            for name, group in managers.items():
                events = []
                for manager in group:
                    assert manager.settle(timeout=30)
                    events.extend(manager.drain(timeout=0).events)
                if not events:
                    continue
                batch = EventBatch(
                    name,
                    events,
                    attention_dp_size=ranks,
                    producer_id=1,
                    sequence=sequence[name],
                    created_at_us=time.time_ns() // 1000,
                )
                sequence[name] += 1
                batches.append(batch)
                total += len(events)
    finally:
        for group in managers.values():
            for manager in group:
                manager.close()
    return batches


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def produce(bootstrap: str, topic: str, batches: list[EventBatch]) -> None:
    from confluent_kafka import Producer
    from kvevents.consumer.topics import TopicSpec, create_topic
    from kvevents.producer.sink_config import DEFAULT_PRODUCER_CONFIG

    create_topic(bootstrap, TopicSpec(topic, partitions=4, max_message_bytes=8 << 20))
    producer = Producer(
        {
            "bootstrap.servers": bootstrap,
            "enable.idempotence": True,
            "compression.type": DEFAULT_PRODUCER_CONFIG["compression.type"],
            "linger.ms": 20,
            "message.max.bytes": 8 << 20,
        }
    )
    for batch in batches:
        while True:
            try:
                producer.produce(topic, key=batch.instance_id.encode(), value=encode_batch(batch))
                break
            except BufferError:
                producer.poll(0.1)
        producer.poll(0)
    assert producer.flush(60) == 0


# ------------------------------------------------------------------ the subscriber process


def subscriber(endpoint: str, decode: bool) -> None:
    """Count (and with ``decode``, time) what arrives until the DONE topic; JSON on stdout."""
    import msgspec
    import zmq

    class Ts(msgspec.Struct, array_like=True):  # vLLM's batch: [ts, events, rank]
        ts: float

    ts_map = msgspec.msgpack.Decoder(Ts)
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.RCVHWM, 0)
    sub.bind(endpoint)  # llm-d's indexer listens; the exporter connects
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    print("ready", flush=True)
    messages = 0
    nbytes = 0
    first = last = None
    latencies: list[float] = []
    while True:
        frames = sub.recv_multipart()
        if frames[0] == DONE:
            break
        now = time.time()
        if first is None:
            first = time.perf_counter()
        last = time.perf_counter()
        messages += 1
        nbytes += len(frames[2])
        if decode:
            latencies.append(now - ts_map.decode(frames[2]).ts)
    sub.close(linger=0)
    ctx.term()
    print(
        json.dumps(
            {
                "messages": messages,
                "bytes": nbytes,
                "seconds": (last - first) if first is not None and last is not None else 0.0,
                "latencies": latencies,
            }
        ),
        flush=True,
    )


@contextlib.contextmanager
def subscriber_process(endpoint: str, decode: bool) -> Iterator[dict[str, Any]]:
    proc = subprocess.Popen(
        [sys.executable, __file__, "--child-subscriber", endpoint] + (["--decode"] if decode else []),
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "ready"
    result: dict[str, Any] = {}
    try:
        yield result
    finally:
        try:
            out, _ = proc.communicate(timeout=60)
            result.update(json.loads(out))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()


# ------------------------------------------------------------------ the measurements


def read_only(bootstrap: str, topic: str) -> dict[str, Any]:
    events = 0
    start, cpu = time.perf_counter(), time.process_time()
    with EventReader(bootstrap, topic) as reader:
        for batch in reader.batches(until_caught_up=True):
            events += len(batch.events)
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    return {
        "events": events,
        "seconds": seconds,
        "events_per_s": events / seconds,
        "cpu_seconds": cpu,
        "cpu_events_per_s": events / cpu,
    }


def export_zmq(bootstrap: str, topic: str, positional: bool) -> dict[str, Any]:
    from kvevents.consumer.export.zmq_export import Endpoint, ZmqExportConfig, ZmqExporter

    port = free_port()
    # the subscriber binds, the exporter connects (llm-d's layout), so nothing is lost at start
    endpoint = f"tcp://127.0.0.1:{port}"
    with subscriber_process(endpoint, decode=False) as seen:
        config = ZmqExportConfig(
            bootstrap, topic, pub=Endpoint(endpoint, bind=False), positional=positional, start_delay_s=0.5
        )
        with ZmqExporter(config) as exporter, relaxed_gc():  # as 'kvevents export zmq' runs
            start, cpu = time.perf_counter(), time.process_time()
            stats = exporter.run(until_caught_up=True)
            seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
            exporter._publishers[0][0].send_multipart([DONE, b"", b""])
            counters = exporter.converter.counters
    events = counters.events_in
    return {
        "encoding": "positional" if positional else "tagged-map",
        "events": events,
        "vllm_events": counters.events_out,
        "batches_published": stats.batches_published,
        "seconds": seconds,
        "events_per_s": events / seconds,
        "cpu_seconds": cpu,
        "cpu_events_per_s": events / cpu,
        "received": seen.get("messages"),
        "received_bytes": seen.get("bytes"),
    }


def export_dynamo(bootstrap: str, topic: str) -> dict[str, Any]:
    import orjson
    from kvevents.consumer.export.dynamo_export import DynamoConverter

    converter = DynamoConverter()
    lines = 0
    start, cpu = time.perf_counter(), time.process_time()
    with open(os.devnull, "wb") as sink, EventReader(bootstrap, topic) as reader, relaxed_gc():
        write = sink.write
        for message in reader.messages(until_caught_up=True):
            for record in converter.convert(decode_batch(message.value())):
                write(orjson.dumps(record) + b"\n")
                lines += 1
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    events = converter.counters.events_in
    return {
        "events": events,
        "lines": lines,
        "seconds": seconds,
        "events_per_s": events / seconds,
        "cpu_seconds": cpu,
        "cpu_events_per_s": events / cpu,
    }


def latency(bootstrap: str, batches: list[EventBatch], rate: float, seconds: float) -> dict[str, Any]:
    from confluent_kafka import Producer
    from kvevents.consumer.export.zmq_export import Endpoint, ZmqExportConfig, ZmqExporter
    from kvevents.consumer.topics import TopicSpec, create_topic

    topic = f"bench-export-live-{uuid.uuid4().hex[:8]}"
    create_topic(bootstrap, TopicSpec(topic, partitions=4, max_message_bytes=8 << 20))
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    producer = Producer({"bootstrap.servers": bootstrap, "enable.idempotence": True, "linger.ms": 0})
    count = int(rate * seconds)
    with subscriber_process(endpoint, decode=True) as seen:
        config = ZmqExportConfig(
            bootstrap, topic, pub=Endpoint(endpoint, bind=False), start="end", start_delay_s=0.5
        )
        with ZmqExporter(config) as exporter:
            thread = threading.Thread(target=exporter.run, kwargs={"timeout": seconds + 5}, daemon=True)
            thread.start()
            started = time.perf_counter()
            sequences: dict[str, int] = {}
            for i in range(count):
                template = batches[i % len(batches)]
                seq = sequences.get(template.instance_id, 0)
                sequences[template.instance_id] = seq + 1
                batch = EventBatch(
                    template.instance_id,
                    template.events,
                    attention_dp_size=template.attention_dp_size,
                    producer_id=template.producer_id,
                    sequence=seq,
                    created_at_us=time.time_ns() // 1000,
                )
                producer.produce(topic, key=batch.instance_id.encode(), value=encode_batch(batch))
                producer.poll(0)
                delay = started + (i + 1) / rate - time.perf_counter()
                if delay > 0:
                    time.sleep(delay)
            producer.flush(30)
            time.sleep(1.0)
            exporter.stop()
            thread.join(timeout=10)
            exporter._publishers[0][0].send_multipart([DONE, b"", b""])
    samples = sorted(seen.get("latencies", []))
    if not samples:
        return {"batches_produced": count, "received": 0}
    ms = [s * 1000 for s in samples]
    return {
        "batches_produced": count,
        "rate_batches_per_s": rate,
        "received": len(ms),
        "p50_ms": round(statistics.median(ms), 2),
        "p99_ms": round(ms[min(len(ms) - 1, int(len(ms) * 0.99))], 2),
        "max_ms": round(ms[-1], 2),
        "note": "ts = just before produce (linger.ms 0); one machine's clock",
    }


def e2e_drop_free(bootstrap: str, rates: list[float], seconds: float) -> dict[str, Any]:
    """The e2e benchmark's drop-free search, in this run: its ``run_step`` per rate (4 ranks),
    stopping as it does; the highest clean step (no drops, none lost, index equal to the truth)."""
    full, best = drop_free_steps(bootstrap, 4, rates, seconds, "e2e step")
    keys = (
        "rate_per_rank",
        "events_per_second",
        "drops",
        "events_lost_unreported",
        "kept_pace",
        "index_equals_truth",
    )
    return {
        "seconds_per_step": seconds,
        "steps": [{key: step[key] for key in keys} for step in full],
        "highest_drop_free_events_per_s": None if best is None else best["events_per_second"],
        "highest_drop_free_rate_per_rank": None if best is None else best["rate_per_rank"],
    }


def baselines() -> dict[str, Any]:
    out: dict[str, Any] = {}
    e2e = RESULTS / "e2e.json"
    if e2e.exists():
        data = json.loads(e2e.read_text())
        best = data.get("highest_drop_free") or {}
        out["e2e_drop_free_events_per_s"] = best.get("events_per_second")
    bridge = RESULTS / "bridge.json"
    if bridge.exists():
        data = json.loads(bridge.read_text())
        out["bridge_ingest_events_per_s"] = _find_rate(data)
    return out


def _find_rate(data: Any) -> float | None:
    """The bridge's ingest rate (``bridge.events_per_s``: engines' ZMQ -> Kafka acks), not its
    bare-decode figure."""
    bridge = data.get("bridge") if isinstance(data, dict) else None
    rate = bridge.get("events_per_s") if isinstance(bridge, dict) else None
    return float(rate) if isinstance(rate, (int, float)) else None


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--events", type=int, default=200_000, help="events in the stream (default 200k)")
    parser.add_argument(
        "--latency-rate", type=float, default=40.0, help="batches/s in the latency run (~430 events each)"
    )
    parser.add_argument("--latency-seconds", type=float, default=5.0)
    parser.add_argument("--repeat", type=int, default=2, help="runs of each throughput case (best kept)")
    parser.add_argument(
        "--e2e-rates",
        default=",".join(f"{r:g}" for r in E2E_RATES),
        help="requests/s per rank of the in-run drop-free search (default %(default)s)",
    )
    parser.add_argument("--e2e-seconds", type=float, default=4.0, help="seconds per e2e step (default 4)")
    parser.add_argument("--child-subscriber", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--decode", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child_subscriber:
        subscriber(args.child_subscriber, args.decode)
        return
    started = time.time()
    print(f"simulating a {args.events}-event stream ...", file=sys.stderr)
    batches = simulated_batches(args.events)
    events = sum(len(b.events) for b in batches)
    by_kind: dict[str, int] = {}
    for batch in batches:
        for event in batch.events:
            name = type(event.data).__name__
            by_kind[name] = by_kind.get(name, 0) + 1
    with kafka_broker() as (bootstrap, source):
        topic = f"bench-export-{uuid.uuid4().hex[:8]}"
        print(f"producing {len(batches)} batches ({events} events) to {topic} ...", file=sys.stderr)
        produce(bootstrap, topic, batches)
        print("measuring ...", file=sys.stderr)
        runs: dict[str, list[dict[str, Any]]] = {"floor": [], "zmq_map": [], "zmq_pos": [], "dynamo": []}
        for _ in range(args.repeat):  # interleaved, best of each kept: the machine is shared
            runs["floor"].append(read_only(bootstrap, topic))
            runs["zmq_map"].append(export_zmq(bootstrap, topic, positional=False))
            runs["zmq_pos"].append(export_zmq(bootstrap, topic, positional=True))
            runs["dynamo"].append(export_dynamo(bootstrap, topic))
        floor, zmq_map, zmq_pos, dynamo = (
            max(runs[name], key=lambda r: r["cpu_events_per_s"])
            for name in ("floor", "zmq_map", "zmq_pos", "dynamo")
        )
        for name, row in (("floor", floor), ("zmq_map", zmq_map), ("zmq_pos", zmq_pos), ("dynamo", dynamo)):
            row["repeats_events_per_s"] = [round(r["events_per_s"]) for r in runs[name]]
            row["repeats_cpu_events_per_s"] = [round(r["cpu_events_per_s"]) for r in runs[name]]
        live = latency(bootstrap, batches[:2000], args.latency_rate, args.latency_seconds)
        print("the e2e drop-free search ...", file=sys.stderr)
        load_before_e2e = os.getloadavg()
        e2e = e2e_drop_free(bootstrap, [float(r) for r in args.e2e_rates.split(",")], args.e2e_seconds)
    base = baselines()
    e2e_rate = e2e["highest_drop_free_events_per_s"]
    bridge_rate = base.get("bridge_ingest_events_per_s")

    def ratio(rate: float, to: float | None) -> float | None:
        return None if not to else round(rate / to, 2)

    rows = [
        ("kafka read + decode (floor)", floor),
        ("export zmq (tagged maps)", zmq_map),
        ("export zmq (positional)", zmq_pos),
        ("export dynamo (JSON lines)", dynamo),
    ]
    print(f"\n{'what':32} {'events/s':>10} {'per CPU-s':>10} {'x e2e (per CPU)':>16} {'x bridge':>9}")
    for name, row in rows:
        rate = row["events_per_s"]
        row["x_e2e_drop_free"] = ratio(rate, e2e_rate)
        row["cpu_x_e2e_drop_free"] = ratio(row["cpu_events_per_s"], e2e_rate)
        row["x_bridge_ingest"] = ratio(rate, bridge_rate)
        x_e2e = f"{row['x_e2e_drop_free'] or '-'} ({row['cpu_x_e2e_drop_free'] or '-'})"
        print(
            f"{name:32} {rate:10,.0f} {row['cpu_events_per_s']:10,.0f} {x_e2e:>16} "
            f"{row['x_bridge_ingest'] or '-':>9}"
        )
    print(
        f"{'e2e drop-free, this run':32} {e2e_rate or 0:10,.0f}   (at {e2e['highest_drop_free_rate_per_rank']} "
        f"requests/s per rank; steps of {args.e2e_seconds:g} s)"
    )
    if base.get("e2e_drop_free_events_per_s"):
        print(f"{'  for reference: results/e2e.json':32} {base['e2e_drop_free_events_per_s']:10,.0f}")
    if bridge_rate:
        print(f"{'bridge ingest (results/bridge.json)':32} {bridge_rate:11,.0f}")
    print(
        f"\nKafka -> subscriber latency at {args.latency_rate:.0f} batches/s: p50 {live.get('p50_ms')} ms, "
        f"p99 {live.get('p99_ms')} ms, max {live.get('max_ms')} ms ({live.get('received')} "
        f"messages timed, {live.get('batches_produced')} batches produced)"
    )
    slowest = min(zmq_map["events_per_s"], zmq_pos["events_per_s"], dynamo["events_per_s"])
    slowest_cpu = min(zmq_map["cpu_events_per_s"], zmq_pos["cpu_events_per_s"], dynamo["cpu_events_per_s"])
    goal = None if not e2e_rate else slowest >= 2 * e2e_rate
    goal_cpu = None if not e2e_rate else slowest_cpu >= 2 * e2e_rate
    verdict = {True: "met", False: "NOT met", None: "n/a"}
    print(
        f"goal (every export >= 2x e2e drop-free): wall clock {verdict[goal]}, per CPU-second "
        f"{verdict[goal_cpu]} (load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs)"
    )
    result = {
        "benchmark": "export",
        "description": __doc__.split("\n")[0],
        "machine": {"cpus": os.cpu_count(), "python": sys.version.split()[0], "kafka": source},
        "stream": {"events": events, "batches": len(batches), "by_kind": by_kind},
        "read_floor": floor,
        "export_zmq_tagged_map": zmq_map,
        "export_zmq_positional": zmq_pos,
        "export_dynamo": dynamo,
        "latency": live,
        "e2e_drop_free_this_run": e2e,
        "baselines_from_other_runs": base,
        "loadavg_before_e2e": load_before_e2e,
        "goal_2x_e2e_met": goal,
        "goal_2x_e2e_met_per_cpu_second": goal_cpu,
        "loadavg_at_end": os.getloadavg(),
        "seconds": round(time.time() - started, 1),
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "export.json").write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
