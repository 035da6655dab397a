"""Benchmark of ``kvevents bridge``: a vLLM-style engine's ZMQ events into Kafka, how fast and how late.

- Engine: another process publishing vLLM's current wire format (tagged maps, ``KVEventBatch``
  with ``data_parallel_rank``, each event naming its KV-cache ``group_idx`` and a Stored one its
  ``kv_cache_spec_kind``) on a PUB with a replay ROUTER, as vLLM's ``ZmqEventPublisher`` does:
  batches of ``--events-per-batch`` events (Stored of 1-4 blocks of 16 tokens, Removed), each
  batch's ``ts`` set when it is sent.
- Throughput, same stream, side by side in one run:
  ``bare``: a SUB that receives and msgpack-decodes only (the ceiling of any bridge);
  ``bridge``: ``ZmqBridge`` + ``KafkaEventSink`` (convert, Avro-encode, produce, acknowledged),
  events/s from the first receive to the last Kafka acknowledgement: ``compiled``, the compiled
  converter writing Avro bytes that the sink splices (the default); and as baselines
  (``--baseline``, on by default) ``objects``, the compiled converter building event objects
  that the sink encodes (``preencoded=False``, the path before), and ``python``, the Python
  paths (``ZmqEventConverter(compiled=False)``, objects).
  Goals: bridge >= 100k events/s and >= 50% of bare.
  Also the CPU per event of the measuring process (steadier than events/s on a busy machine).
  Every engine batch stores blocks of its own (pre-built, none repeated, as an engine stores a
  block once), so the bridge delivers every event the engine sends; events/s counts those
  delivered.
- Latency: the engine sends at a steady ``--latency-rate`` events/s; for sampled batches,
  engine send (batch ts) -> Kafka acknowledgement of the batch's last event, p50/p99.

``--repeat N`` runs every case N times, interleaved, and reports medians. Needs a broker:
``$KAFKA_BOOTSTRAP_SERVERS``, else a local one for the run. Results: ``results/bridge.json``
(with the load average). Default run about a minute on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import statistics
import struct
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import msgspec

RESULTS = Path(__file__).resolve().parent / "results"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# -- engine (child process) -------------------------------------------------------------------


def engine_main(pub_port: int, replay_port: int, batches: int, per_batch: int, rate: float) -> None:
    """Publish ``batches`` batches (``rate`` events/s, 0 = as fast as possible) as vLLM does."""
    import zmq

    opts: dict[str, Any] = {"omit_defaults": True, "gc": False, "tag": True}
    stored_t = msgspec.defstruct(
        "BlockStored",
        [
            ("block_hashes", list[int]),
            ("parent_block_hash", int | None),
            ("token_ids", list[int]),
            ("block_size", int),
            ("lora_id", int | None),
            ("medium", str | None),
            ("lora_name", str | None),
            ("extra_keys", list[Any] | None, None),
            ("group_idx", int | None, None),
            ("kv_cache_spec_kind", str | None, None),
        ],
        **opts,
    )
    removed_t = msgspec.defstruct(
        "BlockRemoved",
        [("block_hashes", list[int]), ("medium", str | None), ("group_idx", int | None, None)],
        **opts,
    )
    batch_t = msgspec.defstruct(
        "KVEventBatch",
        [("ts", float), ("events", list[Any]), ("data_parallel_rank", int | None, None)],
        omit_defaults=True,
        gc=False,
        array_like=True,  # vLLM's EventBatch is an array, its events maps
    )
    enc = msgspec.msgpack.Encoder()
    rng = random.Random(1)
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    pub.set_hwm(100_000)
    pub.bind(f"tcp://127.0.0.1:{pub_port}")
    router = ctx.socket(zmq.ROUTER)
    router.bind(f"tcp://127.0.0.1:{replay_port}")
    buffer: list[tuple[int, bytes]] = []
    counter = 0
    held: list[int] = []
    # Pre-built payloads, one per batch (the engine's own cost is not what is measured): every
    # batch stores blocks of its own, as an engine stores a block once, so every event the engine
    # sends is one the bridge delivers. Token ids come from a small pool (their values do not
    # change the bridge's work); each payload's ``ts`` is patched in when it is sent.
    token_pool = {n: [[rng.randrange(32000) for _ in range(16 * n)] for _ in range(32)] for n in (1, 2, 4)}
    ts_mark = struct.pack(">d", 1234567890.125)
    bodies: list[bytes] = []
    for _ in range(batches):
        events = []
        for _ in range(per_batch):
            if held and rng.random() < 0.4:
                i = rng.randrange(len(held))  # a random held block, taken out in O(1)
                held[i], held[-1] = held[-1], held[i]
                events.append(removed_t([held.pop()], "GPU", 0))
            else:
                n = rng.choice((1, 1, 1, 2, 4))
                hashes = list(range(counter + 1, counter + n + 1))
                parent = counter if counter and rng.random() < 0.5 else None  # the last block stored
                counter += n
                tokens = token_pool[n][rng.randrange(32)]
                # as vLLM 0.26 sends them: a None extra key per block, the group and its spec named
                events.append(
                    stored_t(hashes, parent, tokens, 16, None, "GPU", None, [None] * n, 0, "full_attention")
                )
                held.extend(hashes)
        bodies.append(enc.encode(batch_t(1234567890.125, events, 0)))
    ts_at = bodies[0].index(b"\xcb" + ts_mark) + 1  # the float64 after the "ts" key
    time.sleep(1.0)  # subscribers connect (ZMQ's slow joiner)
    start = time.perf_counter()
    for seq in range(batches):
        body = bodies[seq]
        payload = body[:ts_at] + struct.pack(">d", time.time()) + body[ts_at + 8 :]
        pub.send_multipart((b"kv", seq.to_bytes(8, "big"), payload))
        buffer.append((seq, payload))
        if len(buffer) > 20_000:
            del buffer[:10_000]
        while router.poll(0):
            client, _, start_seq = router.recv_multipart()
            first = int.from_bytes(start_seq, "big")
            for s, p in buffer:
                if s >= first:
                    router.send_multipart((client, b"", b"kv", s.to_bytes(8, "big"), p))
            router.send_multipart((client, b"", b"kv", (2**64 - 1).to_bytes(8, "big"), b""))
        if rate:
            due = start + (seq + 1) * per_batch / rate
            while time.perf_counter() < due:
                time.sleep(max(0.0, min(0.001, due - time.perf_counter())))
    print(
        f"engine: {batches * per_batch / (time.perf_counter() - start):,.0f} events/s sent", file=sys.stderr
    )
    deadline = time.monotonic() + 3.0  # serve late replay requests
    while time.monotonic() < deadline:
        if router.poll(100):
            client, _, start_seq = router.recv_multipart()
            first = int.from_bytes(start_seq, "big")
            for s, p in buffer:
                if s >= first:
                    router.send_multipart((client, b"", b"kv", s.to_bytes(8, "big"), p))
            router.send_multipart((client, b"", b"kv", (2**64 - 1).to_bytes(8, "big"), b""))
    pub.close(0)
    router.close(0)
    ctx.term()


def spawn_engine(batches: int, per_batch: int, rate: float) -> tuple[subprocess.Popen[bytes], int, int]:
    pub, replay = free_port(), free_port()
    cmd = [
        sys.executable,
        __file__,
        "--engine-child",
        str(pub),
        str(replay),
        str(batches),
        str(per_batch),
        str(rate),
    ]
    return subprocess.Popen(cmd), pub, replay


# -- cases ------------------------------------------------------------------------------------


def bare(batches: int, per_batch: int) -> dict[str, Any]:
    import zmq

    proc, pub, _ = spawn_engine(batches, per_batch, 0)
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.RCVHWM, 1_000_000)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(f"tcp://127.0.0.1:{pub}")
    dec = msgspec.msgpack.Decoder()
    events = got = 0
    first = last = 0.0
    last_seq = -1
    cpu = time.process_time()
    try:
        while last_seq < batches - 1 and sub.poll(5000):
            _, seq, payload = sub.recv_multipart()
            if not got:
                first = time.perf_counter()
            got += 1
            events += len(dec.decode(payload)[1])  # [ts, events, rank]
            last_seq = int.from_bytes(seq, "big")
            last = time.perf_counter()
        cpu = time.process_time() - cpu
    finally:
        sub.close(0)
        ctx.term()
        proc.wait(30)
    seconds = max(last - first, 1e-9)
    return {
        "batches": got,
        "events": events,
        "seconds": seconds,
        "events_per_s": events / seconds,
        "cpu_us_per_event": 1e6 * cpu / max(events, 1),
        "lost_batches": batches - got,
    }


def bridged(
    bootstrap: str, batches: int, per_batch: int, rate: float, sample_every: int, path: str
) -> dict[str, Any]:
    from kvevents.consumer.topics import TopicSpec, create_topic
    from kvevents.producer import KafkaEventSink
    from kvevents.producer.bridge.live import ZmqBridge

    topic = f"bench-bridge-{uuid.uuid4().hex[:8]}"
    create_topic(bootstrap, TopicSpec(topic))
    proc, pub, replay = spawn_engine(batches, per_batch, rate)
    bridge = ZmqBridge(
        "vllm",
        f"tcp://127.0.0.1:{pub}",
        replay_endpoint=f"tcp://127.0.0.1:{replay}",
        idle_probe=3600,
        preencoded=path == "compiled",
    )
    conv = bridge.converters[0]
    conv.compiled = path != "python" and conv.compiled  # before the engine's first batch (1 s away)
    samples: list[tuple[int, float]] = []  # (last event id of a batch, its engine send ts)
    latencies: list[float] = []
    convert = conv.convert
    n = 0

    def sampled_convert(payload: bytes) -> Any:
        nonlocal n
        out = convert(payload)
        n += 1
        if out and n % sample_every == 0 and conv.last_batch_ts is not None:
            samples.append((out[-1].event_id, conv.last_batch_ts))
        return out

    convert_encoded = conv.convert_encoded

    def sampled_convert_encoded(payload: bytes, out: Any) -> bool:
        nonlocal n
        before = len(out)
        taken = convert_encoded(payload, out)
        n += 1
        if taken and len(out) > before and n % sample_every == 0 and conv.last_batch_ts is not None:
            samples.append((out.event_id(len(out) - 1), conv.last_batch_ts))
        return taken

    conv.convert = sampled_convert  # type: ignore[method-assign]
    conv.convert_encoded = sampled_convert_encoded  # type: ignore[method-assign]
    acked: list[float] = []

    def on_delivery(report: Any) -> None:
        bridge.on_delivery(report)
        now = time.time()
        acked.append(time.perf_counter())
        last = report.last_event_id_by_rank.get(0, -1)
        while samples and samples[0][0] <= last:
            latencies.append(now - samples.pop(0)[1])

    sink = KafkaEventSink(
        bridge,
        topic,
        "bench-engine",
        config={"bootstrap.servers": bootstrap, "linger.ms": 5},
        on_delivery=on_delivery,
    )
    bridge.watch(sink)
    cpu = time.process_time()  # this process: the bridge's and the sink's threads, librdkafka's
    try:
        deadline = time.monotonic() + 120
        while (bridge.last_seq[0] or -1) < batches - 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        sink.wait_delivered(60)
        cpu = time.process_time() - cpu
        stats = bridge.stats()
        sink_stats = sink.stats()
        delivered = sink_stats.events_delivered_total
    finally:
        bridge.close()
        sink.close(30)
        proc.wait(30)
    seconds = (acked[-1] - bridge_first[0]) if acked and bridge_first else float("nan")
    lat = sorted(latencies)
    return {
        "events_delivered": delivered,
        "seconds": seconds,
        "events_per_s": delivered / seconds if seconds == seconds and seconds > 0 else 0.0,
        "cpu_us_per_event": 1e6 * cpu / max(delivered, 1),
        "kafka_messages": sink_stats.messages_produced_total,
        "latency_ms_p50": 1000 * lat[len(lat) // 2] if lat else None,
        "latency_ms_p99": 1000 * lat[min(len(lat) - 1, int(len(lat) * 0.99))] if lat else None,
        "latency_samples": len(lat),
        "gaps": stats["gaps"],
        "replayed_batches": stats["replayed_batches"],
        "batches_lost": stats["batches_lost"],
        "queue_dropped": sum(stats["queue_dropped_by_rank"].values()),
        "compiled_payloads": conv.compiled_payloads,
    }


bridge_first: list[float] = []


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--engine-child":
        engine_main(
            int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]), float(sys.argv[6])
        )
        return 0
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batches", type=int, default=20_000, help="engine batches in the throughput runs")
    parser.add_argument("--events-per-batch", type=int, default=16)
    parser.add_argument("--latency-rate", type=float, default=20_000, help="events/s of the latency run")
    parser.add_argument("--latency-seconds", type=float, default=4.0)
    parser.add_argument(
        "--baseline",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also run the bridge with event objects (compiled converter, then the Python paths)",
    )
    parser.add_argument("--repeat", type=int, default=1, help="runs of every case (medians reported)")
    args = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from export import kafka_broker
    from kvevents.producer.bridge.convert import compiled_convert

    if compiled_convert is None:
        print("the compiled converter is not built (make setup): both paths are Python", file=sys.stderr)
    paths = ["python", "objects", "compiled"] if args.baseline else ["compiled"]
    lat_batches = int(args.latency_rate * args.latency_seconds / args.events_per_batch)
    runs: dict[str, list[dict[str, Any]]] = {"bare": []}
    for path in paths:
        runs[f"{path}_throughput"] = []
        runs[f"{path}_latency"] = []
    load = [os.getloadavg()]
    with kafka_broker() as (bootstrap, where):
        print(f"broker: {where} ({bootstrap})", file=sys.stderr)
        for k in range(args.repeat):
            base = bare(args.batches, args.events_per_batch)
            runs["bare"].append(base)
            print(f"[{k + 1}] bare SUB decode: {base['events_per_s']:,.0f} events/s", file=sys.stderr)
            for path in paths:
                through = _timed_bridge(bootstrap, args.batches, args.events_per_batch, 0, 50, path)
                through["ratio_to_bare"] = through["events_per_s"] / max(base["events_per_s"], 1e-9)
                runs[f"{path}_throughput"].append(through)
                print(
                    f"[{k + 1}] bridge ({path}) -> Kafka: {through['events_per_s']:,.0f} events/s "
                    f"({through['ratio_to_bare']:.0%} of bare)",
                    file=sys.stderr,
                )
            for path in paths:
                latency = _timed_bridge(
                    bootstrap, lat_batches, args.events_per_batch, args.latency_rate, 5, path
                )
                runs[f"{path}_latency"].append(latency)
            load.append(os.getloadavg())
    summary = {name: _medians(rows) for name, rows in runs.items()}
    rows = [
        (
            "bare SUB + msgpack decode",
            _fmt(summary["bare"]["events_per_s"]),
            "",
            f"{summary['bare']['cpu_us_per_event']:.2f}",
            "",
            "",
        )
    ]
    for path in paths:
        t, lat = summary[f"{path}_throughput"], summary[f"{path}_latency"]
        rows.append(
            (
                f"bridge ({path}) -> Kafka",
                _fmt(t["events_per_s"]),
                f"{t['ratio_to_bare']:.0%} of bare",
                f"{t['cpu_us_per_event']:.2f}",
                f"p50 {_ms(lat['latency_ms_p50'])}",
                f"p99 {_ms(lat['latency_ms_p99'])}",
            )
        )
    latency_head = f"@ {_fmt(args.latency_rate)} ev/s"
    print(f"{'case':30} {'events/s':>10} {'':>12} {'CPU us/ev':>10} {latency_head:>14} {'':>14}")
    for row in rows:
        print(f"{row[0]:30} {row[1]:>10} {row[2]:>12} {row[3]:>10} {row[4]:>14} {row[5]:>14}")
    new = summary["compiled_throughput"]
    if args.baseline:
        for base in ("objects", "python"):
            old = summary[f"{base}_throughput"]
            print(
                f"compiled / {base}: {new['events_per_s'] / max(old['events_per_s'], 1e-9):.2f}x events/s, "
                f"{old['cpu_us_per_event'] / max(new['cpu_us_per_event'], 1e-9):.2f}x less CPU per event"
            )
    goals = {
        "events_per_s >= 100k": new["events_per_s"] >= 100_000,
        "ratio >= 0.5": new["ratio_to_bare"] >= 0.5,
    }
    print("goals: " + ", ".join(f"{k}: {'met' if v else 'NOT met'}" for k, v in goals.items()))
    print(f"load average (1 min) during the run: {', '.join(f'{x[0]:.1f}' for x in load)}")
    RESULTS.mkdir(exist_ok=True)
    out = {
        "args": vars(args),
        "medians": summary,
        "runs": runs,
        "goals": goals,
        "load_average": load,
        "broker": where,
        "when": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    (RESULTS / "bridge.json").write_text(json.dumps(out, indent=2) + "\n")
    return 0


def _medians(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per numeric field, the median over the runs."""
    out: dict[str, Any] = {}
    for key in rows[0]:
        values = [r[key] for r in rows if isinstance(r.get(key), (int, float))]
        if values:
            out[key] = statistics.median(values)
    return out


def _fmt(value: float) -> str:
    return f"{value:,.0f}"


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f} ms"


def _timed_bridge(
    bootstrap: str, batches: int, per_batch: int, rate: float, sample_every: int, path: str
) -> dict[str, Any]:
    """``bridged`` with the clock started at the bridge's first received message."""
    import kvevents.producer.bridge.receiver as receiver

    original = receiver.ZmqReceiver._run

    def timed_run(self: Any) -> None:
        q = self.queue
        put = q.put_nowait

        def first_put(item: Any) -> None:
            if not bridge_first:
                bridge_first.append(time.perf_counter())
            put(item)

        q.put_nowait = first_put
        original(self)

    bridge_first.clear()
    receiver.ZmqReceiver._run = timed_run  # type: ignore[method-assign]
    try:
        return bridged(bootstrap, batches, per_batch, rate, sample_every, path)
    finally:
        receiver.ZmqReceiver._run = original  # type: ignore[method-assign]


if __name__ == "__main__":
    sys.exit(main())
