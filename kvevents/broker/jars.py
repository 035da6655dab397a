"""Fetch Apache Kafka's jars from Maven Central once, into a cache directory.

The broker needs no Docker and no tarball: Maven resolves ``org.apache.kafka:kafka_2.13`` with
its dependencies plus a log4j2 backend for slf4j 1.x (Kafka 4.1 logs through slf4j-api 1.7),
and copies the jars into ``<cache>/kafka-<version>/libs``. The copy lands under a temporary name
and is renamed into place only when complete, under a file lock, so that concurrent first starts
fetch once and an interrupted fetch leaves nothing half-done behind.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "KAFKA_ARTIFACT",
    "KAFKA_VERSION",
    "LOG4J_VERSION",
    "FetchError",
    "KafkaDistribution",
    "cache_root",
    "ensure_kafka_jars",
    "file_lock",
    "find_maven",
    "render_pom",
    "run_maven",
]

KAFKA_VERSION = "4.1.1"
"""The pinned Apache Kafka release (``org.apache.kafka:kafka_2.13``)."""
KAFKA_ARTIFACT = ("org.apache.kafka", "kafka_2.13", KAFKA_VERSION)
LOG4J_VERSION = "2.24.3"
"""log4j2 backend; ``log4j-slf4j-impl`` is the binding for slf4j-api 1.7 that Kafka 4.1 uses."""
DEPENDENCY_PLUGIN = "org.apache.maven.plugins:maven-dependency-plugin:3.8.1"

_DEPENDENCIES = (
    KAFKA_ARTIFACT,
    ("org.apache.logging.log4j", "log4j-core", LOG4J_VERSION),
    ("org.apache.logging.log4j", "log4j-slf4j-impl", LOG4J_VERSION),
)
_MANIFEST = "kvevents-manifest.json"
_MAVEN_TIMEOUT_S = 600.0


class FetchError(RuntimeError):
    """The Kafka jars could not be fetched (Maven missing or failing)."""


@dataclass(frozen=True)
class KafkaDistribution:
    """A complete set of Kafka jars on disk."""

    version: str
    home: Path
    """``<cache>/kafka-<version>``: holds ``libs/`` and per-version caches (the CDS archive)."""
    fetched_now: bool = False
    fetch_seconds: float = 0.0

    @property
    def libs(self) -> Path:
        return self.home / "libs"

    @property
    def classpath(self) -> str:
        """A JVM class path naming every jar (``libs/*``)."""
        return str(self.libs / "*")


def cache_root() -> Path:
    """``$KVEVENTS_CACHE_DIR`` if set, else ``$XDG_CACHE_HOME/kvevents`` or ``~/.cache/kvevents``."""
    explicit = os.environ.get("KVEVENTS_CACHE_DIR")
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "kvevents"


def render_pom(version: str = KAFKA_VERSION) -> str:
    """The throwaway Maven project whose dependencies are the broker's class path."""
    deps = "\n".join(
        "    <dependency>"
        f"<groupId>{group}</groupId><artifactId>{artifact}</artifactId><version>{ver}</version>"
        "</dependency>"
        for group, artifact, ver in _with_kafka_version(version)
    )
    return (
        '<project xmlns="http://maven.apache.org/POM/4.0.0">\n'
        "  <modelVersion>4.0.0</modelVersion>\n"
        "  <groupId>kvevents.local</groupId><artifactId>kafka-broker-classpath</artifactId>\n"
        f"  <version>{version}</version><packaging>pom</packaging>\n"
        f"  <dependencies>\n{deps}\n  </dependencies>\n"
        "</project>\n"
    )


def _with_kafka_version(version: str) -> tuple[tuple[str, str, str], ...]:
    return tuple(
        (group, artifact, version if (group, artifact) == KAFKA_ARTIFACT[:2] else ver)
        for group, artifact, ver in _DEPENDENCIES
    )


def _is_complete(home: Path, version: str) -> bool:
    manifest = home / "libs" / _MANIFEST
    try:
        jars = json.loads(manifest.read_text())["jars"]
    except (OSError, ValueError, KeyError):
        return False
    return f"kafka_2.13-{version}.jar" in jars and all((home / "libs" / jar).is_file() for jar in jars)


@contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """Hold an exclusive lock on ``path`` (created with its folders): one process at a time fetches into
    a cache or starts a broker, however many are launched at once."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def find_maven(why: str, error: type[Exception] = FetchError) -> str:
    """The ``mvn`` on PATH; ``error`` saying it is needed once to ``why`` when there is none."""
    mvn = shutil.which("mvn")
    if mvn is None:
        raise error(f"Maven ('mvn') is not on PATH: it is needed once to {why}")
    return mvn


def run_maven(
    command: list[str],
    what: str,
    *,
    error: type[Exception] = FetchError,
    timeout_s: float = _MAVEN_TIMEOUT_S,
    cwd: Path | None = None,
) -> None:
    """Run ``command`` (``mvn`` and its arguments) quietly; ``error`` naming ``what`` if it does not
    finish within ``timeout_s`` or fails (with the last 25 lines of its output)."""
    try:
        result = subprocess.run(
            command, capture_output=True, text=True, timeout=timeout_s, stdin=subprocess.DEVNULL, cwd=cwd
        )
    except subprocess.TimeoutExpired as exc:
        raise error(f"Maven did not fetch {what} within {timeout_s:.0f} s") from exc
    if result.returncode != 0:
        tail = "\n".join((result.stdout + result.stderr).strip().splitlines()[-25:])
        raise error(f"Maven failed (exit {result.returncode}) to fetch {what}:\n{tail}")


def ensure_kafka_jars(version: str = KAFKA_VERSION, cache: Path | None = None) -> KafkaDistribution:
    """Return the Kafka jars of ``version``, fetching them with Maven the first time."""
    home = (cache or cache_root()) / f"kafka-{version}"
    if _is_complete(home, version):
        return KafkaDistribution(version, home)
    with file_lock(home / ".fetch.lock"):
        if _is_complete(home, version):  # another process fetched while we waited
            return KafkaDistribution(version, home)
        started = time.monotonic()
        _fetch(home, version)
        return KafkaDistribution(version, home, fetched_now=True, fetch_seconds=time.monotonic() - started)


def _fetch(home: Path, version: str) -> None:
    mvn = find_maven(
        "fetch Apache Kafka's jars from Maven Central (install it, e.g. 'apt-get install maven'), "
        "or set KAFKA_BOOTSTRAP_SERVERS to use another broker"
    )
    with tempfile.TemporaryDirectory(prefix="fetch-", dir=home) as work:
        work_dir = Path(work)
        (work_dir / "pom.xml").write_text(render_pom(version))
        staged = work_dir / "libs"
        command = [
            mvn, "-q", "-B", "-Dstyle.color=never", "-f", str(work_dir / "pom.xml"),
            f"{DEPENDENCY_PLUGIN}:copy-dependencies", f"-DoutputDirectory={staged}",
            "-DincludeScope=runtime",
        ]  # fmt: skip
        run_maven(command, f"Kafka {version}'s jars")
        jars = sorted(p.name for p in staged.glob("*.jar"))
        if f"kafka_2.13-{version}.jar" not in jars:
            raise FetchError(f"Maven ran but kafka_2.13-{version}.jar is missing from {sorted(jars)}")
        (staged / _MANIFEST).write_text(json.dumps({"version": version, "jars": jars}, indent=1))
        target = home / "libs"
        if target.exists():  # an incomplete earlier copy
            shutil.rmtree(target)
        staged.rename(target)
    # Archives of loaded classes refer to the old jars by size and time: drop them.
    shutil.rmtree(home / "cds", ignore_errors=True)
