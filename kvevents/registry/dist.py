"""Fetch Apicurio Registry from Maven Central once, unpacked into the cache, and find its Java.

``io.apicurio:apicurio-registry-app:<version>:tar.gz:all`` is a Quarkus application
(``quarkus-run.jar`` and its libraries); Maven copies the archive (``mvn dependency:copy``), it
is unpacked under a temporary name and renamed into place only when complete, under a file
lock, like Kafka's jars (:mod:`kvevents.broker.jars`). 3.3.x needs Java 21 or newer: a JDK is
looked for in ``$KVEVENTS_REGISTRY_JAVA``, ``$JAVA_HOME``, ``java`` on PATH, then
``/usr/lib/jvm/*``. (3.0.9, which runs on Java 17, is not fetchable: Maven Central lacks its
parent POM.)
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tarfile
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from kvevents.broker.jars import DEPENDENCY_PLUGIN, cache_root, file_lock, find_maven, run_maven

__all__ = [
    "APICURIO_VERSION",
    "MIN_JAVA",
    "RegistryDistribution",
    "RegistryFetchError",
    "ensure_registry",
    "find_registry_java",
    "java_major",
]

APICURIO_VERSION = "3.3.3"
"""The pinned Apicurio Registry release (``io.apicurio:apicurio-registry-app``)."""
MIN_JAVA = 21
JAVA_ENV = "KVEVENTS_REGISTRY_JAVA"
_MAVEN_TIMEOUT_S = 900.0
_COMPLETE = ".kvevents-complete"


class RegistryFetchError(RuntimeError):
    """Apicurio Registry could not be fetched, or no suitable Java was found."""


@dataclass(frozen=True)
class RegistryDistribution:
    """An unpacked Apicurio Registry."""

    version: str
    home: Path
    fetched_now: bool = False
    fetch_seconds: float = 0.0

    @property
    def runner(self) -> Path:
        """``quarkus-run.jar``, the application's launcher."""
        return self.home / "quarkus-run.jar"


def java_major(java: str) -> int | None:
    """The major version of the ``java`` launcher (``java -version``), None if it does not run."""
    try:
        result = subprocess.run(
            [java, "-version"], capture_output=True, text=True, timeout=30, stdin=subprocess.DEVNULL
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    found = re.search(r'version "(\d+)(?:\.(\d+))?', result.stderr + result.stdout)
    if found is None:
        return None
    major = int(found.group(1))
    return int(found.group(2) or 0) if major == 1 else major  # "1.8" is Java 8


def _candidates() -> Iterator[str]:
    explicit = os.environ.get(JAVA_ENV)
    if explicit:
        yield explicit
    home = os.environ.get("JAVA_HOME")
    if home:
        yield str(Path(home) / "bin" / "java")
    on_path = shutil.which("java")
    if on_path:
        yield on_path
    for jdk in sorted(Path("/usr/lib/jvm").glob("*"), reverse=True):
        yield str(jdk / "bin" / "java")


def find_registry_java() -> str:
    """A ``java`` of version 21 or newer; RegistryFetchError naming what was found otherwise."""
    seen: list[str] = []
    for java in _candidates():
        if not os.access(java, os.X_OK):
            continue
        major = java_major(java)
        if major is not None and major >= MIN_JAVA:
            return java
        seen.append(f"{java} (Java {major})")
    raise RegistryFetchError(
        f"Apicurio Registry {APICURIO_VERSION} needs Java {MIN_JAVA} or newer; found "
        + (", ".join(seen) or "no java")
        + f" (set {JAVA_ENV} to a newer one)"
    )


def _is_complete(home: Path) -> bool:
    return (home / _COMPLETE).is_file() and (home / "quarkus-run.jar").is_file()


def ensure_registry(version: str = APICURIO_VERSION, cache: Path | None = None) -> RegistryDistribution:
    """Return Apicurio Registry ``version`` unpacked, fetching it with Maven the first time."""
    root = (cache or cache_root()) / f"apicurio-registry-{version}"
    home = root / "app"
    if _is_complete(home):
        return RegistryDistribution(version, home)
    with file_lock(root / ".fetch.lock"):
        if _is_complete(home):
            return RegistryDistribution(version, home)
        started = time.monotonic()
        _fetch(root, home, version)
        return RegistryDistribution(version, home, fetched_now=True, fetch_seconds=time.monotonic() - started)


def _fetch(root: Path, home: Path, version: str) -> None:
    mvn = find_maven("fetch Apicurio Registry from Maven Central", RegistryFetchError)
    with tempfile.TemporaryDirectory(prefix="fetch-", dir=root) as work:
        work_dir = Path(work)
        artifact = f"io.apicurio:apicurio-registry-app:{version}:tar.gz:all"
        command = [
            mvn, "-q", "-B", "-Dstyle.color=never", f"{DEPENDENCY_PLUGIN}:copy",
            f"-Dartifact={artifact}", f"-DoutputDirectory={work_dir}",
        ]  # fmt: skip
        run_maven(command, artifact, error=RegistryFetchError, timeout_s=_MAVEN_TIMEOUT_S, cwd=work_dir)
        archives = list(work_dir.glob("apicurio-registry-app-*.tar.gz"))
        if not archives:
            raise RegistryFetchError(f"Maven ran but left no archive of {artifact} in {work_dir}")
        staged = work_dir / "app"
        staged.mkdir()
        with tarfile.open(archives[0]) as archive:
            archive.extractall(staged, filter="data")
        entries = list(staged.iterdir())
        if not (staged / "quarkus-run.jar").is_file() and len(entries) == 1 and entries[0].is_dir():
            staged = entries[0]  # an archive with a top-level folder (3.0.x)
        if not (staged / "quarkus-run.jar").is_file():
            raise RegistryFetchError(f"{archives[0].name} holds no quarkus-run.jar")
        (staged / _COMPLETE).write_text(version + "\n")
        if home.exists():
            shutil.rmtree(home)
        staged.rename(home)
