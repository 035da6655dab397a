"""``kvevents bridge vllm`` as a process, killed with SIGKILL mid-stream and restarted with the
same --state: the index built from the topic equals the engines' true caches and no worker is
degraded (nothing lost: replay; nothing counted twice: acknowledged event ids are skipped)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import zmq
from bridge_engines import FakeEnginePublisher, TrueCacheEngine
from kvevents.consumer import CacheIndex, EventReader
from test_bridge_live import INSTANCE, free_ports, held

pytestmark = pytest.mark.slow


def start_bridge(base: int, replay: int, state: Path, bootstrap: str, topic: str) -> subprocess.Popen[str]:
    cmd = [
        sys.executable,
        "-c",
        "import sys; from kvevents.cli import main; sys.exit(main())",
        "bridge",
        "vllm",
        "--endpoint",
        f"tcp://127.0.0.1:{base}",
        "--dp-size",
        "2",
        "--replay-endpoint",
        f"tcp://127.0.0.1:{replay}",
        "--instance-id",
        INSTANCE,
        "--state",
        str(state),
        "--checkpoint-interval",
        "0.2",
        "-b",
        bootstrap,
        "-t",
        topic,
        "-q",
    ]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


second_err: list[str] = []


def wait_started(proc: subprocess.Popen[str], timeout: float = 30.0) -> bool:
    """Collect the bridge's stderr in the background; True once its start line was printed."""
    started = threading.Event()
    second_err.clear()

    def read() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            second_err.append(line)
            if " -> " in line:
                started.set()

    threading.Thread(target=read, daemon=True).start()
    return started.wait(timeout)


def test_sigkill_and_restart_loses_and_duplicates_nothing(
    kafka_bootstrap: str, kafka_topic: str, tmp_path: Path
) -> None:
    ctx = zmq.Context()
    base, replay = free_ports(2), free_ports(2)
    engines = [TrueCacheEngine("vllm", r, seed=7 + r) for r in range(2)]
    for e in engines:
        e.clears = False
    pubs = [
        FakeEnginePublisher(ctx, f"tcp://127.0.0.1:{base + r}", f"tcp://127.0.0.1:{replay + r}")
        for r in range(2)
    ]
    stop = threading.Event()

    def run_engines() -> None:
        while not stop.is_set():
            for r in range(2):
                pubs[r].send(engines[r].batch())
            time.sleep(0.002)

    state = tmp_path / "bridge.state"
    engine_thread = threading.Thread(target=run_engines, daemon=True)
    first = start_bridge(base, replay, state, kafka_bootstrap, kafka_topic)
    second = None
    try:
        engine_thread.start()
        deadline = time.monotonic() + 20
        while not state.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert state.exists(), first.stderr.read() if first.poll() is not None else "no state saved"
        time.sleep(0.7)
        first.send_signal(signal.SIGKILL)
        first.wait(10)
        time.sleep(0.4)  # the engines go on; these batches reach nobody
        second = start_bridge(base, replay, state, kafka_bootstrap, kafka_topic)
        assert wait_started(second), "the restarted bridge did not start"
        time.sleep(1.0)
        stop.set()
        engine_thread.join(5)
        time.sleep(1.5)
        second.send_signal(signal.SIGTERM)
        out, _ = second.communicate(timeout=60)
        err = "".join(second_err)
        assert second.returncode == 0, err
        summary = json.loads(out)
        assert summary["batches_lost"] == 0 and summary["replayed_batches"] > 0, summary
        assert summary["last_seq"] == {"0": pubs[0].seq - 1, "1": pubs[1].seq - 1}
    finally:
        stop.set()
        for proc in (first, second):
            if proc is not None and proc.poll() is None:
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait(10)
        for p in pubs:
            p.close()
        ctx.term()
    index = CacheIndex()
    with EventReader(kafka_bootstrap, kafka_topic) as reader:
        reader.apply_to(index)
    assert index.degraded_workers() == [], [
        index.worker_stats(k).degraded_reasons for k in index.degraded_workers()
    ]
    for r, engine in enumerate(engines):
        assert held(index, r) == engine.truth()
    counters = index.counters()
    assert counters.get("events_duplicate", 0) == 0
