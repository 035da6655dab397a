"""A local Apache Kafka broker without Docker: single node, KRaft, from Maven Central's jars.

``LocalBroker(state_dir)`` fetches the jars once, writes the config, formats the storage on the
first start, runs ``kafka.Kafka`` as a background JVM, and returns from :meth:`LocalBroker.start`
when the broker answers; :meth:`LocalBroker.stop` sends SIGTERM, then SIGKILL (and says so).
Start-up tuning and the state directory: ``docs/OPERATIONS.md``.

    with LocalBroker(tmp_path / "kafka") as broker:
        produce_to(broker.bootstrap_servers)
"""

from __future__ import annotations

import hashlib
import logging
import os
import shlex
import shutil
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager, suppress
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

from kvevents._spawn import pid_alive, process_argv, spawn

from .config import (
    DEFAULT_HOST,
    NODE_ID,
    BrokerLayout,
    BrokerPorts,
    BrokerState,
    choose_ports,
    default_state_dir,
    new_cluster_id,
    render_log4j2_properties,
    render_server_properties,
)
from .gclog import gc_log_option
from .jars import KAFKA_VERSION, KafkaDistribution, ensure_kafka_jars, file_lock
from .probe import BrokerNotAnswering, metadata_answers, wait_for_metadata

__all__ = [
    "FAST_START_JVM_OPTIONS",
    "BrokerAlreadyRunning",
    "BrokerError",
    "BrokerStartError",
    "BrokerStatus",
    "LocalBroker",
    "StopResult",
    "default_state_dir",
    "find_java",
]

log = logging.getLogger(__name__)

FAST_START_JVM_OPTIONS: tuple[str, ...] = (
    "-XX:+UseSerialGC",
    "-XX:TieredStopAtLevel=1",
    "-XX:+ExitOnOutOfMemoryError",
    "-Djava.awt.headless=true",
)
"""JVM flags that roughly halve the broker's start-up (measured: ~2.9 s to ~2.0 s, ~1.0 s with
the class-data archive). ``KVEVENTS_BROKER_JVM_OPTS`` replaces them, e.g. for throughput runs."""
DEFAULT_HEAP = "512m"
_TAIL_LINES = 40
_ARCHIVE_DUMP_STOP_TIMEOUT = 60.0
_PORT_CLASH_MARKERS = ("Address already in use", "BindException")


class BrokerError(RuntimeError):
    """The local broker could not be started, stopped or found."""


class BrokerStartError(BrokerError):
    """The broker did not come up; the message quotes the tail of its log."""


class BrokerAlreadyRunning(BrokerError):
    """``start`` found a live broker in the same state directory."""

    def __init__(self, status: BrokerStatus) -> None:
        super().__init__(
            f"a broker is already running in {status.state_dir} (pid {status.pid}, {status.bootstrap_servers})"
        )
        self.status = status


class _PortClash(BrokerStartError):
    """A freely chosen port was taken between choosing it and the JVM binding it."""


@dataclass(frozen=True)
class BrokerStatus:
    """What ``status`` reports: running or not, pid, address, files."""

    state_dir: Path
    running: bool
    pid: int | None
    bootstrap_servers: str | None
    log_file: Path
    answers: bool | None = None
    """Whether it answered a metadata request (None when not asked)."""
    note: str | None = None

    def describe(self) -> str:
        """One line for people."""
        if not self.running:
            text = f"stopped (state in {self.state_dir})"
        else:
            text = f"running, pid {self.pid}, bootstrap {self.bootstrap_servers}"
            if self.answers is not None:
                text += (
                    ", answering metadata requests" if self.answers else ", NOT answering metadata requests"
                )
        return f"{text}; {self.note}" if self.note else text


@dataclass(frozen=True)
class StopResult:
    """What ``stop`` did."""

    was_running: bool
    pid: int | None
    killed: bool
    seconds: float
    timeout: float = 0.0
    """How long it waited after SIGTERM before SIGKILL."""

    def describe(self) -> str:
        """One line for people."""
        if not self.was_running:
            return "no broker was running"
        if self.killed:
            return f"broker pid {self.pid} did not exit within {self.timeout:.0f} s of SIGTERM: killed with SIGKILL"
        return f"broker pid {self.pid} stopped cleanly in {self.seconds:.1f} s"


def find_java() -> str:
    """The ``java`` launcher: ``$JAVA_HOME/bin/java``, else the one on PATH."""
    home = os.environ.get("JAVA_HOME")
    if home and os.access(Path(home) / "bin" / "java", os.X_OK):
        return str(Path(home) / "bin" / "java")
    found = shutil.which("java")
    if found is None:
        raise BrokerError("no 'java' on PATH and no JAVA_HOME: the local Kafka broker needs Java 17 or newer")
    return found


def tail_of(path: Path, offset: int = 0, lines: int = _TAIL_LINES) -> str:
    """The last ``lines`` lines of a log file written after byte ``offset`` ("" when unreadable)."""
    try:
        with open(path, "rb") as handle:
            size = handle.seek(0, os.SEEK_END)
            start = offset if offset <= size else 0
            handle.seek(max(start, size - 256 * 1024))
            text = handle.read().decode(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.strip().splitlines()[-lines:])


def _read_cluster_id(layout: BrokerLayout) -> str | None:
    try:
        for line in (layout.data_dir / "meta.properties").read_text().splitlines():
            key, _, value = line.partition("=")
            if key.strip() == "cluster.id":
                return value.strip()
    except OSError:
        return None
    return None


class LocalBroker:
    """A single-node KRaft Kafka broker in ``state_dir``; a context manager that starts and stops it.

    ``port`` / ``controller_port``: listener ports (free ones when None; a restart reuses the
    previous ones when they are still free). ``client_config``: what a client needs besides the
    address (e.g. the SASL_SSL settings of :mod:`kvevents.broker.security`; used to ask the
    broker whether it answers). ``node_id``, ``quorum_voters`` and ``cluster_id`` make it one
    node of a cluster (:class:`kvevents.broker.cluster.LocalCluster`). ``extra_properties`` add or override broker
    settings. ``stop_with_parent`` makes the kernel stop the broker when the process (strictly:
    the thread) that started it dies, so that a crashed test run leaves no JVM behind.
    """

    def __init__(
        self,
        state_dir: str | os.PathLike[str] | None = None,
        *,
        port: int | None = None,
        controller_port: int | None = None,
        host: str = DEFAULT_HOST,
        start_timeout: float = 90.0,
        stop_timeout: float = 20.0,
        heap: str | None = None,
        jvm_options: Sequence[str] | None = None,
        extra_properties: Mapping[str, str] | None = None,
        client_config: Mapping[str, str] | None = None,
        node_id: int = NODE_ID,
        quorum_voters: str | None = None,
        cluster_id: str | None = None,
        stop_with_parent: bool = False,
        version: str = KAFKA_VERSION,
        cache_dir: str | os.PathLike[str] | None = None,
        class_data_sharing: bool | None = None,
    ) -> None:
        self.layout = BrokerLayout(Path(state_dir) if state_dir is not None else default_state_dir())
        self.port = port
        self.controller_port = controller_port
        self.host = host
        self.start_timeout = start_timeout
        self.stop_timeout = stop_timeout
        self.heap = heap or os.environ.get("KVEVENTS_BROKER_HEAP") or DEFAULT_HEAP
        env_options = os.environ.get("KVEVENTS_BROKER_JVM_OPTS")
        if jvm_options is not None:
            self.jvm_options = tuple(jvm_options)
        elif env_options is not None:
            self.jvm_options = tuple(shlex.split(env_options))
        else:
            self.jvm_options = FAST_START_JVM_OPTIONS
        self.extra_properties = dict(extra_properties or {})
        self.client_config = dict(client_config or {})
        self.node_id = node_id
        self.quorum_voters = quorum_voters
        self.cluster_id = cluster_id
        self.stop_with_parent = stop_with_parent
        self.version = version
        self.cache_dir = Path(cache_dir) if cache_dir is not None else None
        if class_data_sharing is None:
            class_data_sharing = os.environ.get("KVEVENTS_BROKER_CDS", "1") not in ("0", "false", "no")
        self.class_data_sharing = class_data_sharing
        self._process: subprocess.Popen[bytes] | None = None
        self.last_start_seconds: float | None = None
        self.last_start_phases: dict[str, float] = {}

    # -- public -----------------------------------------------------------------------------

    @property
    def state_dir(self) -> Path:
        return self.layout.state_dir

    @property
    def gc_log(self) -> Path:
        """The JVM's log of garbage-collection pauses (``kvevents.broker.gclog``); not written
        when ``jvm_options`` bring their own ``-Xlog:gc``."""
        return self.layout.gc_log

    @property
    def bootstrap_servers(self) -> str:
        """``host:port`` of the running broker's client listener."""
        state = BrokerState.load(self.layout)
        if state is None or self._running_pid() is None:
            raise BrokerError(f"no broker is running in {self.state_dir}")
        return state.bootstrap_servers

    def start(self) -> BrokerStatus:
        """Start the broker and wait until it answers a metadata request.

        Raises :class:`BrokerAlreadyRunning` when one runs in this state directory, and
        :class:`BrokerStartError` (quoting the broker's log) when it does not come up in time.
        """
        started = time.monotonic()
        self.layout.state_dir.mkdir(parents=True, exist_ok=True)
        with file_lock(self.layout.lock_file):
            if self._running_pid() is not None:
                raise BrokerAlreadyRunning(self.status())
            java = find_java()
            phase = time.monotonic()
            dist = ensure_kafka_jars(self.version, self.cache_dir)
            self.last_start_phases = {"fetch": time.monotonic() - phase}
            previous = BrokerState.load(self.layout)
            if previous is not None and previous.cds_pending:
                Path(previous.cds_pending).unlink(missing_ok=True)
            auto_ports = self.port is None or self.controller_port is None
            attempts = 3 if auto_ports else 1
            for attempt in range(attempts):
                remembered = previous.ports if previous is not None and attempt == 0 else None
                ports = choose_ports(self.host, self.port, self.controller_port, remembered)
                try:
                    status = self._start_once(java, dist, ports, check_clash=auto_ports)
                except _PortClash:
                    if attempt + 1 == attempts:
                        raise
                    log.info("port clash on %s, retrying with other ports", ports)
                    continue
                self.last_start_seconds = time.monotonic() - started
                return status
        raise AssertionError("unreachable")

    def stop(self, timeout: float | None = None) -> StopResult:
        """Stop the broker: SIGTERM, wait up to ``timeout`` (default ``stop_timeout``), then SIGKILL."""
        timeout = self.stop_timeout if timeout is None else timeout
        if not self.layout.state_dir.is_dir():
            return StopResult(False, None, False, 0.0)
        with file_lock(self.layout.lock_file):
            pid = self._running_pid()
            state = BrokerState.load(self.layout)
            if pid is None:
                self.layout.clear_pid()
                self._settle_class_data_archive(state, keep=False)
                return StopResult(False, None, False, 0.0)
            if state is not None and state.cds_pending:
                # The JVM dumps its class-data archive on the way out: a few seconds more.
                timeout = max(timeout, _ARCHIVE_DUMP_STOP_TIMEOUT)
            started = time.monotonic()
            killed = False
            with _suppress_gone():
                os.kill(pid, signal.SIGTERM)
            if not self._wait_exit(pid, timeout):
                log.warning("broker pid %d ignored SIGTERM for %.0f s: sending SIGKILL", pid, timeout)
                with _suppress_gone():
                    os.kill(pid, signal.SIGKILL)
                killed = True
                if not self._wait_exit(pid, 10.0):
                    raise BrokerError(f"broker pid {pid} survived SIGKILL")
            self.layout.clear_pid()
            self._settle_class_data_archive(state, keep=not killed)
            self._process = None
            return StopResult(True, pid, killed, time.monotonic() - started, timeout)

    def status(self, probe: bool = False) -> BrokerStatus:
        """Running or stopped, pid, bootstrap address; with ``probe``, whether it answers metadata."""
        pid = self._running_pid()
        state = BrokerState.load(self.layout)
        stale = pid is None and self.layout.read_pid() is not None
        note = "stale pid file (the process is gone)" if stale else None
        if pid is None:
            return BrokerStatus(self.state_dir, False, None, None, self.layout.log_file, note=note)
        bootstrap = state.bootstrap_servers if state is not None else None
        answers = metadata_answers(bootstrap, 2.0, self.client_config) if probe and bootstrap else None
        return BrokerStatus(self.state_dir, True, pid, bootstrap, self.layout.log_file, answers=answers)

    def wait(self) -> int | None:
        """Block until the broker process exits (it must have been started by this object)."""
        if self._process is None:
            raise BrokerError("wait() needs a broker started by this LocalBroker")
        return self._process.wait()

    def __enter__(self) -> LocalBroker:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"LocalBroker({str(self.state_dir)!r})"

    # -- internals --------------------------------------------------------------------------

    def _running_pid(self) -> int | None:
        """The pid of this state directory's live broker, or None."""
        pid = self.layout.read_pid()
        if pid is None:
            return None
        if self._process is not None and self._process.pid == pid and self._process.poll() is not None:
            return None
        if not pid_alive(pid):
            return None
        argv = process_argv(pid)
        if argv is not None and ("kafka.Kafka" not in argv or str(self.layout.server_properties) not in argv):
            return None  # the pid was reused by an unrelated process
        return pid

    def _wait_exit(self, pid: int, timeout: float) -> bool:
        if self._process is not None and self._process.pid == pid:
            try:
                self._process.wait(timeout)
            except subprocess.TimeoutExpired:
                return False
            return True
        deadline = time.monotonic() + timeout
        while pid_alive(pid):
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.05)
        return True

    def _write_configs(self, ports: BrokerPorts) -> None:
        layout = self.layout
        layout.config_dir.mkdir(parents=True, exist_ok=True)
        # 0600: the properties may hold passwords (a SASL listener's users, a keystore's).
        layout.server_properties.touch(mode=0o600)
        layout.server_properties.chmod(0o600)
        layout.server_properties.write_text(
            render_server_properties(
                layout,
                ports,
                self.host,
                self.extra_properties,
                node_id=self.node_id,
                quorum_voters=self.quorum_voters,
            )
        )
        layout.log4j_properties.write_text(render_log4j2_properties(layout.log_file))

    def _format(self, java: str, dist: KafkaDistribution, cluster_id: str) -> None:
        command = [
            java, "-Xmx256m", *self.jvm_options, "-cp", dist.classpath, "kafka.tools.StorageTool",
            "format", "-t", cluster_id, "-c", str(self.layout.server_properties),
        ]  # fmt: skip
        if self.quorum_voters is None:
            command.insert(command.index("format") + 1, "--standalone")  # else a static quorum
        result = subprocess.run(
            command, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL
        )
        if result.returncode != 0:
            output = "\n".join((result.stdout + result.stderr).strip().splitlines()[-_TAIL_LINES:])
            raise BrokerStartError(
                f"formatting the broker storage in {self.layout.data_dir} failed (exit {result.returncode}):\n{output}"
            )

    def _class_data_archive(self, java: str, dist: KafkaDistribution) -> Path:
        """Where this JVM and these flags keep their archive of loaded classes."""
        real = os.path.realpath(java)
        key = "\0".join([real, str(os.stat(real).st_mtime_ns), self.heap, *self.jvm_options])
        digest = hashlib.sha256(key.encode()).hexdigest()[:16]
        return dist.home / "cds" / f"broker-{digest}.jsa"

    def _java_command(self, java: str, dist: KafkaDistribution, state: BrokerState) -> list[str]:
        command = [java, f"-Xmx{self.heap}", *self.jvm_options]
        if self.class_data_sharing:
            archive = self._class_data_archive(java, dist)
            if archive.is_file():
                command.append(f"-XX:SharedArchiveFile={archive}")
            else:
                archive.parent.mkdir(parents=True, exist_ok=True)
                pending = archive.with_name(f"{archive.stem}.{os.getpid()}-{time.time_ns()}.tmp")
                state.cds_pending = str(pending)
                command.append(f"-XX:ArchiveClassesAtExit={pending}")
        gc_log = gc_log_option(self.layout.gc_log)
        if gc_log and not any(option.startswith(("-Xlog:gc:", "-Xlog:gc*")) for option in self.jvm_options):
            command.append(gc_log)
        command += [
            f"-Dlog4j2.configurationFile={self.layout.log4j_properties}",
            f"-Dkafka.logs.dir={self.layout.state_dir}",
            "-cp", dist.classpath, "kafka.Kafka", str(self.layout.server_properties),
        ]  # fmt: skip
        return command

    def _settle_class_data_archive(self, state: BrokerState | None, keep: bool) -> None:
        """Move the archive the JVM dumped at a clean exit into the cache; drop it otherwise."""
        if state is None or not state.cds_pending:
            return
        pending = Path(state.cds_pending)
        if keep and pending.is_file() and pending.stat().st_size > 0:
            final = pending.with_name(pending.name.split(".", 1)[0] + ".jsa")
            os.replace(pending, final)
        else:
            pending.unlink(missing_ok=True)
        state.cds_pending = None
        state.save(self.layout)

    def _start_once(
        self, java: str, dist: KafkaDistribution, ports: BrokerPorts, check_clash: bool
    ) -> BrokerStatus:
        layout = self.layout
        phase = time.monotonic()
        self._write_configs(ports)
        cluster_id = _read_cluster_id(layout) if layout.formatted else None
        if cluster_id is None:
            cluster_id = self.cluster_id or new_cluster_id()
            self._format(java, dist, cluster_id)
        self.last_start_phases["format"] = time.monotonic() - phase
        state = BrokerState(
            host=self.host,
            client_port=ports.client,
            controller_port=ports.controller,
            cluster_id=cluster_id,
            kafka_version=dist.version,
            started_at=time.time(),
        )
        command = self._java_command(java, dist, state)
        log_offset = layout.log_file.stat().st_size if layout.log_file.exists() else 0
        phase = time.monotonic()
        with open(layout.out_file, "wb") as out:
            process = spawn(command, out, layout.state_dir, die_with_parent=self.stop_with_parent)
        self._process = process
        layout.write_pid(process.pid)
        state.save(layout)

        def exited() -> str | None:
            code = process.poll()
            return None if code is None else f"the broker JVM exited with code {code}"

        try:
            wait_for_metadata(state.bootstrap_servers, self.start_timeout, exited, config=self.client_config)
        except RuntimeError as exc:
            self._after_failed_start(state)
            tails = self._log_tails(log_offset)
            if check_clash and any(marker in tails for marker in _PORT_CLASH_MARKERS):
                raise _PortClash(f"a port of {ports} was taken before the broker bound it.\n{tails}") from exc
            raise BrokerStartError(
                f"Kafka broker in {self.state_dir} failed to start: {exc}.\n{tails}"
            ) from exc
        except BrokerNotAnswering as exc:
            with _suppress_gone():
                process.terminate()
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
            self._after_failed_start(state)
            raise BrokerStartError(
                f"Kafka broker in {self.state_dir}: {exc}; stopped it.\n{self._log_tails(log_offset)}"
            ) from exc
        self.last_start_phases["jvm"] = time.monotonic() - phase
        return BrokerStatus(
            self.state_dir, True, process.pid, state.bootstrap_servers, layout.log_file, answers=True
        )

    def _after_failed_start(self, state: BrokerState) -> None:
        self.layout.clear_pid()
        self._settle_class_data_archive(state, keep=False)
        self._process = None

    def _log_tails(self, log_offset: int) -> str:
        parts = []
        out = tail_of(self.layout.out_file)
        if out:
            parts.append(f"--- JVM output ({self.layout.out_file}) ---\n{out}")
        log_tail = tail_of(self.layout.log_file, log_offset)
        if log_tail:
            parts.append(f"--- last lines of {self.layout.log_file} ---\n{log_tail}")
        return "\n".join(parts) or f"(the broker wrote no log; see {self.layout.state_dir})"


def _suppress_gone() -> AbstractContextManager[None]:
    """Ignore signalling a process that has just exited."""
    return suppress(ProcessLookupError)
