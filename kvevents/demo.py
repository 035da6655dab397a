"""The whole pipeline on one machine: ``kvevents demo`` (and ``make demo``).

1. Kafka: the configured broker (``--bootstrap-servers``, ``$KAFKA_BOOTSTRAP_SERVERS`` or a
   running local broker), else a local broker started here and stopped at the end;
2. a fresh topic;
3. ``instances`` concurrent ``mpiexec -n ranks kvevents simulate`` launches (one engine
   instance of ``ranks`` attention-DP ranks each) for ``duration_s`` seconds, each writing its
   workers' ground truth;
4. a :class:`~kvevents.consumer.CacheIndex` rebuilt from the topic by an
   :class:`~kvevents.consumer.EventReader`, compared with the ground truth
   (:mod:`kvevents.verify`);
5. routing on held-out requests of the same workload (:mod:`kvevents.routing_eval`):
   prefix-cache hit rate when routing by the index, round-robin and random.

Nothing is left running: the simulators are waited for (a Ctrl-C is forwarded to them once, as
a clean stop), and a broker the demo started is stopped.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["DemoError", "DemoOptions", "DemoReport", "run_demo"]


class DemoError(RuntimeError):
    """A step of the demo failed (the message says which and why)."""


@dataclass
class DemoOptions:
    """What the demo runs; the defaults are the documented demo."""

    duration_s: float = 30.0
    instances: int = 2
    ranks: int = 4
    rate: float = 10.0
    """Requests per second per rank."""
    seed: int = 0
    held_out: int = 400
    """Held-out requests for the routing evaluation (spread over the workers)."""
    bootstrap_servers: str | None = None
    topic: str | None = None
    """None: a fresh ``kvevents-demo-<time>`` topic."""
    partitions: int = 2
    kafka_config: dict[str, str] = field(default_factory=dict)
    schema_registry: dict[str, str] | None = None
    """Schema registry client settings (``url``, ...): the simulators write Confluent's framing
    and the rebuild reads it."""
    simulate_args: tuple[str, ...] = ()
    """Further ``kvevents simulate`` flags (engine and workload knobs)."""
    workdir: Path | None = None
    """Where the ground-truth files go (default: a temporary directory, removed at the end)."""


@dataclass
class DemoReport:
    """Everything the demo measured (``to_json`` for ``--json``)."""

    topic: str
    bootstrap_servers: str
    broker_started: bool
    instances: int
    ranks: int
    simulate: list[dict[str, Any]]
    rebuild: dict[str, Any]
    verify: dict[str, Any]
    routing: dict[str, Any]
    seconds: dict[str, float]

    @property
    def ok(self) -> bool:
        return bool(self.verify.get("ok"))

    def to_json(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "topic": self.topic,
            "bootstrap_servers": self.bootstrap_servers,
            "broker_started": self.broker_started,
            "instances": self.instances,
            "ranks": self.ranks,
            "simulate": self.simulate,
            "rebuild": self.rebuild,
            "verify": self.verify,
            "routing": self.routing,
            "seconds": self.seconds,
        }

    def describe(self) -> str:
        """The short printed report."""
        sims = self.simulate
        requests = sum(s["requests"] for s in sims)
        events = sum(s["events"] for s in sims)
        delivered = sum(s["events_delivered"] or 0 for s in sims)
        nbytes = sum(s["bytes_delivered"] or 0 for s in sims)
        messages = sum(s["messages_delivered"] or 0 for s in sims)
        drops = sum(s["drops"] for s in sims)
        sim_seconds = max(s["seconds"] for s in sims)
        rb = self.rebuild
        rate = rb["events"] / rb["seconds"] if rb["seconds"] else 0.0
        v = self.verify
        blocks = sum(w["blocks"] for w in v["workers"])
        verdict = "EQUALS" if v["ok"] else "DIFFERS FROM"
        r = self.routing["hit_rate"]
        t = self.seconds
        return "\n".join(
            [
                f"kvevents demo: {self.instances} instances x {self.ranks} attention-DP ranks, topic {self.topic} "
                f"on {self.bootstrap_servers}{' (local broker started for the demo)' if self.broker_started else ''}",
                f"  engines : {requests:,} requests, {events:,} events in {sim_seconds:.1f} s "
                f"({events / sim_seconds if sim_seconds else 0:,.0f} events/s), drops {drops}",
                f"  kafka   : {delivered:,} events, {nbytes:,} bytes in {messages:,} messages delivered",
                f"  rebuild : {rb['events']:,} events from {rb['messages']:,} messages in {rb['seconds']:.2f} s "
                f"({rate:,.0f} events/s ingest), {rb['malformed']} malformed",
                f"  index   : {verdict} the ground truth ({v['equal_workers']}/{len(v['workers'])} workers equal, "
                f"{blocks:,} blocks)",
                f"  routing : {self.routing['requests']} held-out requests, prefix-cache hit rate "
                f"by index {r['index']:.1%}, round-robin {r['round_robin']:.1%}, random {r['random']:.1%} "
                f"(best possible {r['oracle']:.1%})",
                "  time    : " + ", ".join(f"{k} {v:.1f} s" for k, v in t.items()),
            ]
        )


def _mpiexec() -> str:
    from kvevents.producer import find_mpiexec

    found = find_mpiexec()
    if found is None:
        raise DemoError("mpiexec not found beside the interpreter nor on PATH: pip install 'kvevents[mpi]'")
    return found


def _configured_bootstrap(explicit: str | None) -> str | None:
    from kvevents.broker.bootstrap import NoBrokerConfigured, resolve_bootstrap_servers

    try:
        return resolve_bootstrap_servers(explicit)
    except NoBrokerConfigured:
        return None


def _simulate_argv(opts: DemoOptions, bootstrap: str, topic: str, instance: int, truth: Path) -> list[str]:
    argv = [
        "simulate", "--instance-prefix", "engine", "--first-instance", str(instance),
        "--duration", str(opts.duration_s), "--rate", str(opts.rate), "--seed", str(opts.seed),
        "--bootstrap-servers", bootstrap, "--topic", topic, "--ground-truth", str(truth), "--json", "-q",
    ]  # fmt: skip
    for key, value in opts.kafka_config.items():
        argv += ["-X", f"{key}={value}"]
    for key, value in (opts.schema_registry or {}).items():
        argv += ["-X", f"schema.registry.{key}={value}"]
    return argv + list(opts.simulate_args)


def _run_simulators(
    opts: DemoOptions, bootstrap: str, topic: str, workdir: Path, say: Callable[[str], None]
) -> tuple[list[dict[str, Any]], list[Path], list[list[str]]]:
    mpiexec = _mpiexec()
    procs: list[subprocess.Popen[str]] = []
    truths = [workdir / f"truth-{k}.jsonl" for k in range(opts.instances)]
    argvs = [_simulate_argv(opts, bootstrap, topic, k, truths[k]) for k in range(opts.instances)]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    try:
        for argv in argvs:
            # -disable-auto-cleanup: a rank that dies does not take its instance down (the
            # summary names it, and the demo fails on it, with the other ranks' figures).
            command = [
                mpiexec, "-disable-auto-cleanup", "-n", str(opts.ranks),
                sys.executable, "-m", "kvevents.cli", *argv,
            ]  # fmt: skip
            procs.append(subprocess.Popen(
                command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True
            ))  # fmt: skip
        say(
            f"running {opts.instances} x 'mpiexec -n {opts.ranks} kvevents simulate' for {opts.duration_s:g} s ..."
        )
        outputs = [p.communicate() for p in procs]
    except BaseException:
        for p in procs:  # one SIGINT: mpiexec forwards it and the ranks stop cleanly
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGINT)
        for p in procs:
            try:
                p.communicate(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.communicate()
        raise
    summaries = []
    for k, (p, (out, err)) in enumerate(zip(procs, outputs, strict=True)):
        if p.returncode != 0:
            raise DemoError(f"simulator instance {k} exited {p.returncode}:\n{err[-3000:]}{out[-2000:]}")
        try:
            summaries.append(json.loads(out))
        except json.JSONDecodeError:
            raise DemoError(
                f"simulator instance {k} printed no JSON summary:\n{out[-2000:]}{err[-2000:]}"
            ) from None
    return summaries, truths, argvs


def _held_out_requests(argv: list[str], summary: dict[str, Any], per_worker: int, seed: int) -> list[Any]:
    """Held-out requests of each worker's stream, continued where the simulator left it."""
    from kvevents.producer.simulator.workload import WorkloadGenerator

    from kvevents.cli import build_parser
    from kvevents.commands.simulate import config_from_args

    config = config_from_args(build_parser().parse_args(argv), None)
    requests = []
    for rank in summary["per_rank"]:
        dp_rank = rank["attention_dp_rank"] if rank["attention_dp_size"] > 1 else None
        generator = WorkloadGenerator(config.workload_for(rank["instance_id"], dp_rank))
        generator.take(rank["requests_arrived"])
        requests += generator.held_out(per_worker, seed=seed)
    return requests


def run_demo(opts: DemoOptions, say: Callable[[str], None] = lambda text: None) -> DemoReport:
    """Run the demo (see the module docstring); ``say`` gets progress lines."""
    from kvevents.consumer import CacheIndex, EventReader
    from kvevents.consumer.topics import TopicSpec, create_topic

    from kvevents.broker import LocalBroker
    from kvevents.routing_eval import evaluate_routing
    from kvevents.verify import compare, load_ground_truth

    seconds: dict[str, float] = {}
    started = time.monotonic()
    broker = None
    bootstrap = _configured_bootstrap(opts.bootstrap_servers)
    tmp = None
    try:
        if bootstrap is None:
            say("no Kafka configured: starting a local broker (kvevents broker start) ...")
            broker = LocalBroker()
            status = broker.start()
            bootstrap = status.bootstrap_servers or broker.bootstrap_servers
            seconds["broker start"] = time.monotonic() - started
        topic = opts.topic or f"kvevents-demo-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
        create_topic(bootstrap, TopicSpec(topic, partitions=opts.partitions))
        if opts.workdir is None:
            tmp = tempfile.TemporaryDirectory(prefix="kvevents-demo-")
            workdir = Path(tmp.name)
        else:
            workdir = opts.workdir
            workdir.mkdir(parents=True, exist_ok=True)

        t0 = time.monotonic()
        summaries, truth_files, argvs = _run_simulators(opts, bootstrap, topic, workdir, say)
        seconds["simulate"] = time.monotonic() - t0
        truths = [t for path in truth_files for t in load_ground_truth(path)]

        say(f"rebuilding the index from {topic} ...")
        t0 = time.monotonic()
        index = CacheIndex()
        codec = None
        if opts.schema_registry is not None:
            from kvevents.schemas.registry import RegistryCodec

            codec = RegistryCodec(opts.schema_registry, topic, auto_register=False)
        with EventReader(bootstrap, topic, config=opts.kafka_config, codec=codec) as reader:
            read = reader.apply_to(index)
        seconds["rebuild"] = time.monotonic() - t0
        report = compare(index, truths)

        t0 = time.monotonic()
        per_worker = max(1, opts.held_out // max(1, len(truths)))
        held_out = [
            r for argv, summary in zip(argvs, summaries, strict=True)
            for r in _held_out_requests(argv, summary, per_worker, opts.seed)
        ]  # fmt: skip
        routing = evaluate_routing(index, truths, held_out, seed=opts.seed)
        seconds["routing"] = time.monotonic() - t0
        seconds["total"] = time.monotonic() - started
        return DemoReport(
            topic=topic,
            bootstrap_servers=bootstrap,
            broker_started=broker is not None,
            instances=opts.instances,
            ranks=opts.ranks,
            simulate=[{k: v for k, v in s.items() if k != "per_rank"} for s in summaries],
            rebuild={
                "messages": read.messages,
                "events": read.events,
                "bytes": read.bytes,
                "malformed": read.malformed,
                "seconds": read.seconds,
            },
            verify=report.to_json() | {"text": report.describe()},
            routing=routing.to_json(),
            seconds={k: round(v, 2) for k, v in seconds.items()},
        )
    finally:
        if tmp is not None:
            tmp.cleanup()
        if broker is not None:
            say("stopping the local broker ...")
            broker.stop()
