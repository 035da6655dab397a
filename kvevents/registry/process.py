"""A local Apicurio Registry (Confluent-compatible API) as a background JVM, bound to 127.0.0.1.

``LocalRegistry(state_dir)`` fetches the registry once (:mod:`.dist`), starts
``quarkus-run.jar`` with both the HTTP and the management interface on ``host`` (free ports
unless given; without the management flags Quarkus would open 0.0.0.0:9000), storage in memory,
and returns from :meth:`LocalRegistry.start` when ``GET <url>/subjects`` answers. The state
directory holds ``registry.pid``, ``registry.json`` (ports, URL) and ``registry.log``, so that
another process can ask for :meth:`~LocalRegistry.status` or :meth:`~LocalRegistry.stop` it.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path
from types import TracebackType

from kvevents._spawn import pid_alive, process_argv, spawn

from .dist import APICURIO_VERSION, RegistryFetchError, ensure_registry, find_registry_java

__all__ = [
    "CCOMPAT_PATH",
    "LocalRegistry",
    "RegistryError",
    "RegistryStatus",
    "default_registry_dir",
    "registry_answers",
]

CCOMPAT_PATH = "/apis/ccompat/v7"
"""Where Apicurio serves the Confluent schema registry API (clients' URL ends with it)."""
DEFAULT_HOST = "127.0.0.1"


class RegistryError(RuntimeError):
    """The local registry could not be started or stopped; the message says why."""


@dataclass(frozen=True)
class RegistryStatus:
    """Running or not, pid, URL, files."""

    state_dir: Path
    running: bool
    pid: int | None
    url: str | None
    log_file: Path
    answers: bool | None = None

    def describe(self) -> str:
        """One line for people."""
        if not self.running:
            return f"stopped (state in {self.state_dir})"
        text = f"running, pid {self.pid}, url {self.url}"
        if self.answers is not None:
            text += ", answering" if self.answers else ", NOT answering"
        return text


def default_registry_dir() -> Path:
    """``$KVEVENTS_REGISTRY_DIR``, else ``./.kvevents/registry``."""
    explicit = os.environ.get("KVEVENTS_REGISTRY_DIR")
    return Path(explicit).expanduser() if explicit else Path.cwd() / ".kvevents" / "registry"


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def registry_answers(url: str, timeout: float = 2.0) -> bool:
    """Whether a Confluent-compatible registry answers ``GET <url>/subjects`` with 200."""
    try:
        with urllib.request.urlopen(f"{url.rstrip('/')}/subjects", timeout=timeout) as response:
            return int(response.status) == 200
    except (OSError, urllib.error.URLError, ValueError):
        return False


def _is_ours(pid: int, runner_marker: str) -> bool:
    argv = process_argv(pid)  # waits out the moment an exec'ing process shows no arguments
    return argv is not None and any(runner_marker in part for part in argv)


class LocalRegistry:
    """Apicurio Registry in ``state_dir``; a context manager that starts and stops it."""

    def __init__(
        self,
        state_dir: str | os.PathLike[str] | None = None,
        *,
        port: int | None = None,
        management_port: int | None = None,
        host: str = DEFAULT_HOST,
        heap: str = "256m",
        start_timeout: float = 120.0,
        stop_timeout: float = 20.0,
        stop_with_parent: bool = False,
        version: str = APICURIO_VERSION,
    ) -> None:
        self.state_dir = Path(state_dir) if state_dir is not None else default_registry_dir()
        self.port = port
        self.management_port = management_port
        self.host = host
        self.heap = heap
        self.start_timeout = start_timeout
        self.stop_timeout = stop_timeout
        self.stop_with_parent = stop_with_parent
        self.version = version
        self.last_start_seconds: float | None = None
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def pid_file(self) -> Path:
        return self.state_dir / "registry.pid"

    @property
    def info_file(self) -> Path:
        return self.state_dir / "registry.json"

    @property
    def log_file(self) -> Path:
        return self.state_dir / "registry.log"

    @property
    def url(self) -> str:
        """The Confluent-compatible API's URL of the running registry."""
        status = self.status()
        if not status.running or status.url is None:
            raise RegistryError(f"no registry is running in {self.state_dir}")
        return status.url

    def _marker(self) -> str:
        return f"-Dkvevents.registry.dir={self.state_dir.resolve()}"

    def _running_pid(self) -> int | None:
        try:
            pid = int(self.pid_file.read_text().strip())
        except (OSError, ValueError):
            return None
        if self._process is not None and self._process.pid == pid and self._process.poll() is not None:
            return None
        return pid if pid_alive(pid) and _is_ours(pid, self._marker()) else None

    def status(self, probe: bool = False) -> RegistryStatus:
        """Running or stopped; with ``probe``, whether it answers."""
        pid = self._running_pid()
        if pid is None:
            return RegistryStatus(self.state_dir, False, None, None, self.log_file)
        try:
            url = json.loads(self.info_file.read_text())["url"]
        except (OSError, ValueError, KeyError):
            url = None
        answers = registry_answers(url) if probe and url else None
        return RegistryStatus(self.state_dir, True, pid, url, self.log_file, answers)

    def start(self) -> RegistryStatus:
        """Start the registry and wait until it answers; an already running one is returned as is."""
        started = time.monotonic()
        self.state_dir.mkdir(parents=True, exist_ok=True)
        current = self.status()
        if current.running:
            return current
        java = find_registry_java()
        dist = ensure_registry(self.version)
        port = self.port or _free_port(self.host)
        management = self.management_port or _free_port(self.host)
        url = f"http://{self.host}:{port}{CCOMPAT_PATH}"
        command = [
            java, f"-Xmx{self.heap}", "-XX:+UseSerialGC", "-XX:TieredStopAtLevel=1",
            f"-Dquarkus.http.host={self.host}", f"-Dquarkus.http.port={port}",
            f"-Dquarkus.management.host={self.host}", f"-Dquarkus.management.port={management}",
            self._marker(), "-jar", str(dist.runner),
        ]  # fmt: skip
        with open(self.log_file, "ab") as log:
            process = spawn(command, log, self.state_dir, die_with_parent=self.stop_with_parent)
        self._process = process
        self.pid_file.write_text(f"{process.pid}\n")
        info = {"url": url, "port": port, "management_port": management, "host": self.host}
        self.info_file.write_text(json.dumps(info | {"version": dist.version}) + "\n")
        deadline = started + self.start_timeout
        while not registry_answers(url, timeout=1.0):
            code = process.poll()
            if code is not None or time.monotonic() >= deadline:
                self.stop()
                why = (
                    f"exited with code {code}"
                    if code is not None
                    else f"did not answer within {self.start_timeout:.0f} s"
                )
                raise RegistryError(
                    f"Apicurio Registry {why}; last lines of {self.log_file}:\n{self._tail()}"
                )
            time.sleep(0.25)
        self.last_start_seconds = time.monotonic() - started
        return RegistryStatus(self.state_dir, True, process.pid, url, self.log_file, True)

    def stop(self, timeout: float | None = None) -> bool:
        """SIGTERM, wait up to ``timeout`` seconds, then SIGKILL; whether one was running."""
        timeout = self.stop_timeout if timeout is None else timeout
        pid = self._running_pid()
        if pid is None:
            self.pid_file.unlink(missing_ok=True)
            return False
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while self._alive(pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        if self._alive(pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            while self._alive(pid):
                time.sleep(0.05)
        self.pid_file.unlink(missing_ok=True)
        self._process = None
        return True

    def _alive(self, pid: int) -> bool:
        if self._process is not None and self._process.pid == pid:
            return self._process.poll() is None
        return pid_alive(pid)

    def _tail(self, lines: int = 30) -> str:
        try:
            text = self.log_file.read_text(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.strip().splitlines()[-lines:])

    def __enter__(self) -> LocalRegistry:
        self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"LocalRegistry({str(self.state_dir)!r})"


def status_json(status: RegistryStatus) -> dict[str, object]:
    """A JSON-ready dict of ``status``."""
    data = asdict(status)
    data["state_dir"] = str(status.state_dir)
    data["log_file"] = str(status.log_file)
    return data


__all__ += ["RegistryFetchError", "status_json"]
