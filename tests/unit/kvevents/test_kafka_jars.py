"""Fetching Kafka's jars: the generated pom, the cache layout, Maven failures (a stand-in mvn);
the Spark job's jars and Apicurio Registry, fetched through the same Maven helpers."""

from __future__ import annotations

import json
import stat
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from kvevents.analytics.spark_jars import SPARK_JARS, ensure_spark_jars
from kvevents.broker.jars import KAFKA_VERSION, FetchError, cache_root, ensure_kafka_jars, render_pom
from kvevents.registry.dist import RegistryFetchError, ensure_registry

POM_NS = {"m": "http://maven.apache.org/POM/4.0.0"}

# A stand-in for mvn: writes the jars named in $FAKE_JARS into -DoutputDirectory, counts its runs.
FAKE_MVN = """#!/bin/sh
echo run >> "$FAKE_MVN_LOG"
if [ -n "$FAKE_MVN_FAIL" ]; then echo "[ERROR] Could not resolve dependencies: $FAKE_MVN_FAIL"; exit 1; fi
for arg in "$@"; do
  case "$arg" in -DoutputDirectory=*) out="${arg#-DoutputDirectory=}";; esac
done
mkdir -p "$out"
for jar in $FAKE_JARS; do echo jar > "$out/$jar"; done
"""


@pytest.fixture
def fake_mvn(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    mvn = bin_dir / "mvn"
    mvn.write_text(FAKE_MVN)
    mvn.chmod(mvn.stat().st_mode | stat.S_IEXEC)
    log = tmp_path / "mvn-runs.log"
    monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")
    monkeypatch.setenv("FAKE_MVN_LOG", str(log))
    monkeypatch.setenv("FAKE_JARS", f"kafka_2.13-{KAFKA_VERSION}.jar kafka-clients-{KAFKA_VERSION}.jar")
    monkeypatch.delenv("FAKE_MVN_FAIL", raising=False)
    return log


def runs(log: Path) -> int:
    return len(log.read_text().splitlines()) if log.exists() else 0


def test_pom_depends_on_kafka_and_the_slf4j1_log4j2_binding() -> None:
    root = ET.fromstring(render_pom())
    deps = {
        (
            d.findtext("m:groupId", namespaces=POM_NS),
            d.findtext("m:artifactId", namespaces=POM_NS),
        ): d.findtext("m:version", namespaces=POM_NS)
        for d in root.iterfind("m:dependencies/m:dependency", POM_NS)
    }
    assert deps[("org.apache.kafka", "kafka_2.13")] == KAFKA_VERSION == "4.1.1"
    assert ("org.apache.logging.log4j", "log4j-slf4j-impl") in deps  # slf4j 1.x binding, not slf4j2
    assert ("org.apache.logging.log4j", "log4j-slf4j2-impl") not in deps
    assert (
        deps[("org.apache.logging.log4j", "log4j-core")]
        == deps[("org.apache.logging.log4j", "log4j-slf4j-impl")]
    )
    assert root.findtext("m:packaging", namespaces=POM_NS) == "pom"


def test_pom_for_another_version() -> None:
    assert "<artifactId>kafka_2.13</artifactId><version>4.0.0</version>" in render_pom("4.0.0")


def test_cache_root_honours_the_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("KVEVENTS_CACHE_DIR", str(tmp_path / "c"))
    assert cache_root() == tmp_path / "c"
    monkeypatch.delenv("KVEVENTS_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_root() == tmp_path / "xdg" / "kvevents"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_root() == tmp_path / "home" / ".cache" / "kvevents"


def test_fetch_once_then_reuse(fake_mvn: Path, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    first = ensure_kafka_jars(cache=cache)
    assert first.fetched_now and runs(fake_mvn) == 1
    assert first.libs == cache / f"kafka-{KAFKA_VERSION}" / "libs"
    assert (first.libs / f"kafka_2.13-{KAFKA_VERSION}.jar").is_file()
    assert first.classpath == f"{first.libs}/*"
    manifest = json.loads((first.libs / "kvevents-manifest.json").read_text())
    assert f"kafka-clients-{KAFKA_VERSION}.jar" in manifest["jars"]
    second = ensure_kafka_jars(cache=cache)
    assert not second.fetched_now and runs(fake_mvn) == 1
    assert [p.name for p in (cache / f"kafka-{KAFKA_VERSION}").iterdir() if p.name.startswith("fetch-")] == []


def test_a_jar_gone_from_the_cache_triggers_a_new_fetch(fake_mvn: Path, tmp_path: Path) -> None:
    dist = ensure_kafka_jars(cache=tmp_path)
    (dist.libs / f"kafka-clients-{KAFKA_VERSION}.jar").unlink()
    (dist.home / "cds").mkdir()
    (dist.home / "cds" / "broker-x.jsa").write_text("stale")
    again = ensure_kafka_jars(cache=tmp_path)
    assert again.fetched_now and runs(fake_mvn) == 2
    assert (again.libs / f"kafka-clients-{KAFKA_VERSION}.jar").is_file()
    assert not (dist.home / "cds").exists(), "class-data archives of replaced jars must go"


def test_maven_failure_quotes_its_output_and_leaves_no_partial_copy(
    fake_mvn: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FAKE_MVN_FAIL", "org.apache.kafka:kafka_2.13:jar:4.1.1")
    with pytest.raises(FetchError, match=r"exit 1[\s\S]*Could not resolve dependencies"):
        ensure_kafka_jars(cache=tmp_path)
    assert not (tmp_path / f"kafka-{KAFKA_VERSION}" / "libs").exists()


def test_maven_without_the_kafka_jar_is_an_error(
    fake_mvn: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FAKE_JARS", "something-else.jar")
    with pytest.raises(FetchError, match=r"kafka_2\.13-4\.1\.1\.jar is missing"):
        ensure_kafka_jars(cache=tmp_path)


def test_missing_maven_is_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(FetchError, match=r"Maven \('mvn'\) is not on PATH"):
        ensure_kafka_jars(cache=tmp_path / "cache")


def test_the_spark_jars_are_fetched_once_then_reused(
    fake_mvn: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    names = sorted(f"{artifact}-{version}.jar" for _, artifact, version in SPARK_JARS)
    monkeypatch.setenv("FAKE_JARS", " ".join(names))
    jars = ensure_spark_jars(cache=tmp_path)
    assert sorted(p.name for p in jars) == names and all(p.is_file() for p in jars)
    assert ensure_spark_jars(cache=tmp_path) == jars and runs(fake_mvn) == 1


def test_a_spark_jar_maven_did_not_copy_is_an_error(
    fake_mvn: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FAKE_JARS", "something-else.jar")
    with pytest.raises(FetchError, match=r"Maven ran but .* are missing"):
        ensure_spark_jars(cache=tmp_path)


def test_maven_failing_to_fetch_the_spark_jars_quotes_its_output(
    fake_mvn: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FAKE_MVN_FAIL", "org.apache.spark:spark-avro")
    with pytest.raises(FetchError, match=r"to fetch the Spark jars:\n.*Could not resolve dependencies"):
        ensure_spark_jars(cache=tmp_path)


def test_maven_failing_to_fetch_the_registry_is_a_registry_error_quoting_its_output(
    fake_mvn: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FAKE_MVN_FAIL", "io.apicurio:apicurio-registry-app")
    with pytest.raises(RegistryFetchError, match=r"exit 1\) to fetch io\.apicurio:[\s\S]*Could not resolve"):
        ensure_registry(cache=tmp_path)
    assert runs(fake_mvn) == 1 and not (tmp_path / "apicurio-registry-3.3.3" / "app").exists()


def test_missing_maven_is_a_clear_error_for_the_registry_and_spark_too(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(RegistryFetchError, match=r"Maven \('mvn'\) is not on PATH: .*Apicurio Registry"):
        ensure_registry(cache=tmp_path / "cache")
    with pytest.raises(FetchError, match=r"Maven \('mvn'\) is not on PATH: .*Spark job's jars"):
        ensure_spark_jars(cache=tmp_path / "cache")
