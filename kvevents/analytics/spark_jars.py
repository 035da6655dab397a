"""Fetch the jars the Spark job needs from Maven Central once, into the kvevents cache.

Spark's Kafka source and Avro functions are not in the pyspark wheel: the job passes these
jars as ``spark.jars``. Only the listed artifacts are copied (``excludeTransitive``): pyspark
already ships Scala, Hadoop and the rest, and adding the resolver's copies of them breaks it.
The copy lands under a temporary name and is renamed into place when complete, under a lock.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from kvevents.broker.jars import DEPENDENCY_PLUGIN, FetchError, cache_root, file_lock, find_maven, run_maven

__all__ = ["SPARK_JARS", "SPARK_VERSION", "ensure_spark_jars"]

SPARK_VERSION = "4.2.0"
"""pyspark's version; the connector jars on Maven Central stop at 4.2.0."""
SPARK_JARS = (
    ("org.apache.spark", "spark-sql-kafka-0-10_2.13", SPARK_VERSION),
    ("org.apache.spark", "spark-token-provider-kafka-0-10_2.13", SPARK_VERSION),
    ("org.apache.spark", "spark-avro_2.13", SPARK_VERSION),
    ("org.apache.kafka", "kafka-clients", "3.9.2"),
    ("org.apache.commons", "commons-pool2", "2.13.1"),
)
_MAVEN_TIMEOUT_S = 600.0


def _jar_names() -> list[str]:
    return sorted(f"{artifact}-{version}.jar" for _, artifact, version in SPARK_JARS)


def _pom() -> str:
    deps = "\n".join(
        f"    <dependency><groupId>{g}</groupId><artifactId>{a}</artifactId><version>{v}</version></dependency>"
        for g, a, v in SPARK_JARS
    )
    return (
        '<project xmlns="http://maven.apache.org/POM/4.0.0">\n  <modelVersion>4.0.0</modelVersion>\n'
        "  <groupId>kvevents.local</groupId><artifactId>spark-job-jars</artifactId>\n"
        f"  <version>{SPARK_VERSION}</version><packaging>pom</packaging>\n"
        f"  <dependencies>\n{deps}\n  </dependencies>\n</project>\n"
    )


def ensure_spark_jars(cache: Path | None = None) -> list[Path]:
    """The jars' paths, fetched with Maven the first time (:class:`FetchError` if it cannot)."""
    home = (cache or cache_root()) / f"spark-{SPARK_VERSION}-jars"
    wanted = [home / name for name in _jar_names()]
    if all(p.is_file() for p in wanted):
        return wanted
    with file_lock(home / ".fetch.lock"):
        if all(p.is_file() for p in wanted):
            return wanted
        mvn = find_maven("fetch the Spark job's jars")
        with tempfile.TemporaryDirectory(prefix="fetch-", dir=home) as work:
            work_dir = Path(work)
            (work_dir / "pom.xml").write_text(_pom())
            staged = work_dir / "jars"
            command = [
                mvn, "-q", "-B", "-Dstyle.color=never", "-f", str(work_dir / "pom.xml"),
                f"{DEPENDENCY_PLUGIN}:copy-dependencies", f"-DoutputDirectory={staged}",
                "-DexcludeTransitive=true",
            ]  # fmt: skip
            run_maven(command, "the Spark jars", timeout_s=_MAVEN_TIMEOUT_S)
            missing = [name for name in _jar_names() if not (staged / name).is_file()]
            if missing:
                raise FetchError(f"Maven ran but {missing} are missing")
            for name in _jar_names():
                (staged / name).replace(home / name)
            (home / "manifest.json").write_text(json.dumps({"jars": _jar_names()}, indent=1))
    return wanted
