"""Processes of a fault case: its own brokers, the producer program, waiting and killing."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from kvevents.broker import LocalBroker, find_java
from kvevents.broker.jars import ensure_kafka_jars

REPO = Path(__file__).resolve().parent.parent
T = TypeVar("T")


def own_broker(state_dir: Path, **properties: str) -> LocalBroker:
    """A broker of this case alone (free ports, its state in ``state_dir``), started; it dies
    with this process if the suite is killed."""
    broker = LocalBroker(state_dir, stop_with_parent=True, extra_properties=properties, heap="384m")
    broker.start()
    return broker


def sigkill_broker(broker: LocalBroker) -> int:
    """SIGKILL the broker's JVM and wait until it is gone; its pid."""
    pid = broker.status().pid
    if pid is None:
        raise RuntimeError(f"no broker running in {broker.state_dir}")
    os.kill(pid, signal.SIGKILL)
    wait_until(lambda: not Path(f"/proc/{pid}").exists() or _zombie(pid), 30, f"broker pid {pid} to die")
    return pid


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] in ("Z", "X")
    except OSError:
        return True


def wait_until(condition: Callable[[], bool], timeout: float, what: str, poll: float = 0.05) -> float:
    """Seconds it took; ``TimeoutError`` naming ``what`` after ``timeout``."""
    started = time.monotonic()
    while not condition():
        if time.monotonic() - started > timeout:
            raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(poll)
    return time.monotonic() - started


def wait_for_value(
    fetch: Callable[[], T], accept: Callable[[T], bool], timeout: float, what: str
) -> tuple[T, float]:
    """Poll ``fetch`` until ``accept`` takes its value; that value and the seconds it took."""
    seen: list[T] = []

    def accepted() -> bool:
        seen[:] = [fetch()]
        return accept(seen[0])

    took = wait_until(accepted, timeout, what)
    return seen[0], took


class Producer:
    """``python -m faults.producer`` in the background; :meth:`result` waits and loads its JSON."""

    def __init__(self, out: Path, bootstrap: str, topic: str, **options: Any) -> None:
        self.out = out
        argv = [
            sys.executable,
            "-m",
            "faults.producer",
            "--bootstrap",
            bootstrap,
            "--topic",
            topic,
            "--out",
            str(out),
        ]
        for key, value in options.items():
            if key == "config":
                for item in value:
                    argv += ["-X", item]
            elif value == "":  # a flag
                argv.append(f"--{key.replace('_', '-')}")
            else:
                argv += [f"--{key.replace('_', '-')}", str(value)]
        self.log = out.with_suffix(".log")
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(
                argv, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )

    def result(self, timeout: float) -> dict[str, Any]:
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise TimeoutError(
                f"the producer did not finish within {timeout:.0f} s; log {self.log}"
            ) from None
        if self.proc.returncode != 0 or not self.out.exists():
            tail = self.log.read_text(errors="replace")[-2000:]
            raise RuntimeError(f"the producer exited {self.proc.returncode}:\n{tail}")
        data: dict[str, Any] = json.loads(self.out.read_text())
        return data

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def first_delivery_after(samples: list[list[float]], since: float) -> float | None:
    """Seconds from ``since`` (wall clock) to the first sample whose delivered count grew."""
    before = None
    for t, delivered, *_ in samples:
        if t < since:
            before = delivered
            continue
        if before is None:
            before = delivered
        elif delivered > before:
            return t - since
    return None


def default_client_quota(bootstrap: str, producer_byte_rate: int | None) -> None:
    """Set (or, with None, remove) the brokers' default producer byte-rate quota, with Kafka's
    own ``kafka.admin.ConfigCommand`` from the same jars."""
    change = ["--delete-config", "producer_byte_rate"]
    if producer_byte_rate is not None:
        change = ["--add-config", f"producer_byte_rate={producer_byte_rate}"]
    command = [
        find_java(), "-Xmx128m", "-XX:TieredStopAtLevel=1", "-cp", ensure_kafka_jars().classpath,
        "kafka.admin.ConfigCommand", "--bootstrap-server", bootstrap, "--alter", *change,
        "--entity-type", "clients", "--entity-default",
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    if done.returncode != 0:
        raise RuntimeError(f"ConfigCommand failed ({done.returncode}): {done.stderr[-1000:]}")


def delivered_all_after(samples: list[list[float]], since: float) -> float | None:
    """Seconds from ``since`` to the sample where the delivered count reached its final value."""
    if not samples:
        return None
    final = samples[-1][1]
    for t, delivered, *_ in samples:
        if t >= since and delivered >= final:
            return t - since
    return None
