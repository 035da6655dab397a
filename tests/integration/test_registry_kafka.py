"""The schema registry end to end: a real Apicurio Registry (Confluent-compatible API) and the
real broker. Producers register the schema and write Confluent's framing; one topic migrates
mid-way from single-object framing to the registry, and readers with a ``RegistryCodec`` read
it whole (batches and the index's fast path); a reader without one counts the registry's
messages as malformed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from confluent_kafka.schema_registry import SchemaRegistryClient
from kafka_streams import StreamMaker, produce, producer
from kvevents.consumer import CacheIndex, EventReader
from kvevents.consumer.topics import TopicSpec, create_topic
from kvevents.producer import KafkaEventSink, KVCacheEventManager
from kvevents.schemas import decode_batch
from kvevents.schemas.registry import RegistryCodec

pytestmark = pytest.mark.kafka


def _topic(bootstrap: str, partitions: int = 2) -> str:
    name = f"registry-{uuid.uuid4().hex[:10]}"
    create_topic(bootstrap, TopicSpec(name, partitions=partitions))
    return name


def _produce_with(bootstrap: str, topic: str, codec: RegistryCodec, batches: list) -> None:  # type: ignore[type-arg]
    p = producer(bootstrap)
    for batch in batches:
        p.produce(topic, value=codec.encode_batch(batch), key=batch.instance_id.encode())
    assert p.flush(30) == 0


def test_a_topic_migrating_to_the_registry_reads_whole(
    kafka_bootstrap: str, schema_registry_url: str
) -> None:
    topic = _topic(kafka_bootstrap)
    maker = StreamMaker(seed=15)
    before, after = maker.batches(40), maker.batches(40)
    produce(kafka_bootstrap, topic, before)  # single-object framing
    writer = RegistryCodec(schema_registry_url, topic)
    _produce_with(kafka_bootstrap, topic, writer, after)  # then Confluent's, mid-topic

    client = SchemaRegistryClient({"url": schema_registry_url})
    registered = client.get_latest_version(f"{topic}-value")
    assert registered.schema_id == writer.schema_id

    reader_codec = RegistryCodec(schema_registry_url, auto_register=False)
    with EventReader(kafka_bootstrap, topic, codec=reader_codec) as reader:
        read = list(reader.batches(until_caught_up=True))
        assert reader.malformed_total == 0
    key = lambda b: (b.instance_id, b.sequence)  # noqa: E731
    assert sorted(read, key=key) == sorted(before + after, key=key)

    fast, expected = CacheIndex(), CacheIndex()
    with EventReader(kafka_bootstrap, topic, codec=reader_codec) as reader:
        result = reader.apply_to(fast)
    for batch in sorted(before + after, key=lambda b: b.sequence):  # per instance, in order
        expected.apply(batch)
    assert result.malformed == 0 and result.messages == 80
    assert fast.counters() == expected.counters()
    assert fast.held_blocks() > 0 and fast.same_state(expected)

    with EventReader(kafka_bootstrap, topic) as plain:  # no registry: its messages are set aside
        assert len(list(plain.batches(until_caught_up=True))) == 40
        assert plain.malformed_total == 40
        assert "Confluent wire format" in plain.malformed[0].error


def test_the_sink_registers_the_schema_and_writes_confluent_framing(
    kafka_bootstrap: str, schema_registry_url: str
) -> None:
    topic = _topic(kafka_bootstrap, partitions=1)
    codec = RegistryCodec(schema_registry_url, topic)
    with (
        KVCacheEventManager(1000) as manager,
        KafkaEventSink(
            manager, topic, "engine-r", config={"bootstrap.servers": kafka_bootstrap}, codec=codec
        ) as sink,
    ):
        manager.enqueue_created_event([8, 2], 16)
        manager.enqueue_stored_event([_block(1, None), _block(2, 1)], 16)
        manager.flush()
        manager.close()
        report = sink.close(30)
    assert report is not None
    schema_id = (
        SchemaRegistryClient({"url": schema_registry_url}).get_latest_version(f"{topic}-value").schema_id
    )
    with EventReader(kafka_bootstrap, topic) as reader:
        values = [m.value() for m in reader.messages(until_caught_up=True)]
    assert values and all(v[0] == 0 and int.from_bytes(v[1:5], "big") == schema_id for v in values)
    events = [e for v in values for e in codec.decode_batch(v).events]
    assert [e.event_id for e in events] == [0, 1]
    with pytest.raises(Exception, match="Confluent wire format"):
        decode_batch(values[0])


def _block(h: int, parent: int | None):  # type: ignore[no-untyped-def]
    from kvevents.producer import BlockInfo

    return BlockInfo(h, parent, [h] * 16)


def _cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvevents.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **(env or {})},
    )


@pytest.mark.slow
def test_cli_simulate_tail_and_index_through_the_registry(
    kafka_bootstrap: str, schema_registry_url: str, tmp_path: Path
) -> None:
    topic = _topic(kafka_bootstrap, partitions=1)
    props = tmp_path / "client.properties"
    props.write_text(
        f"# as kcat -F reads it\nclient.id=kvevents-test\nschema.registry.url={schema_registry_url}\n"
    )
    kafka = ["-b", kafka_bootstrap, "-t", topic]
    sim = _cli("simulate", *kafka, "-F", str(props), "--requests", "15", "--no-realtime", "--json", "-q")
    assert sim.returncode == 0, sim.stderr
    delivered = json.loads(sim.stdout)["events_delivered"]
    assert delivered > 0

    tail = _cli("tail", *kafka, "--schema-registry-url", schema_registry_url, "--from-beginning",
                "--no-follow", "--json", "--no-batches")  # fmt: skip
    assert tail.returncode == 0, tail.stderr
    assert len(tail.stdout.splitlines()) == delivered and "0 malformed" in tail.stderr

    index = _cli("index", *kafka, "-F", str(props), "--json")
    assert index.returncode == 0, index.stderr
    summary = json.loads(index.stdout)["summary"]
    assert summary["malformed"] == 0 and summary["events_applied"] == delivered

    blind = _cli("tail", *kafka, "--from-beginning", "--no-follow")  # no registry given
    assert blind.returncode == 0 and "pass --schema-registry-url" in blind.stderr

    # The analytics commands read the same registry-framed topic through the registry too.
    export = _cli(
        "export",
        "parquet",
        str(tmp_path / "pq"),
        *kafka,
        "--schema-registry-url",
        schema_registry_url,
        "--json",
    )
    assert export.returncode == 0, export.stderr
    exported = json.loads(export.stdout)
    assert exported["malformed"] == 0 and exported["rows"] > 0
    report = _cli("report", *kafka, "--schema-registry-url", schema_registry_url, "--json")
    assert report.returncode == 0, report.stderr
    assert "malformed message" not in report.stderr  # each one would be named on stderr
    blind_export = _cli("export", "parquet", str(tmp_path / "pq-blind"), *kafka, "--json")
    assert json.loads(blind_export.stdout)["malformed"] == json.loads(sim.stdout)["messages_delivered"]


def test_schema_register_and_a_v1_writer_mid_topic(kafka_bootstrap: str, schema_registry_url: str) -> None:
    """``kvevents schema register`` puts v1 then the current schema under FULL_TRANSITIVE; the
    real registry refuses an incompatible one; a message an old (v1) producer wrote with its
    registry id is read on the same topic as the current producer's."""
    import io

    import fastavro
    from confluent_kafka.schema_registry import Schema
    from confluent_kafka.schema_registry.error import SchemaRegistryError
    from kvevents.schemas._reference import batch_to_record

    from kvevents.schema_versions import schema_versions

    topic = _topic(kafka_bootstrap, partitions=1)
    done = _cli("schema", "register", "-t", topic, "--schema-registry-url", schema_registry_url, "--json")
    assert done.returncode == 0, done.stderr
    ids = json.loads(done.stdout)["ids"]
    client = SchemaRegistryClient({"url": schema_registry_url})
    assert client.get_compatibility(f"{topic}-value") == "FULL_TRANSITIVE"
    assert [v.schema_id for v in map(lambda n: client.get_version(f"{topic}-value", n), (1, 2))] == [
        ids["v1"],
        ids["current"],
    ]

    broken = json.loads(schema_versions()[-1].text)
    broken["fields"].append({"name": "tenant", "type": "string"})
    with pytest.raises(SchemaRegistryError) as refused:
        client.register_schema(f"{topic}-value", Schema(json.dumps(broken), "AVRO"))
    assert refused.value.http_status_code == 409

    batch = StreamMaker(seed=3).batch(events=6)
    record = batch_to_record(batch)
    for event in record["events"]:
        name, data = event["data"]
        if name == "kvevents.KVCacheCreatedData":
            data.pop("snapshot", None)
    v1 = fastavro.parse_schema(json.loads(schema_versions()[0].text))
    body = io.BytesIO()
    fastavro.schemaless_writer(body, v1, record)
    old_message = b"\x00" + int(ids["v1"]).to_bytes(4, "big") + body.getvalue()
    writer = RegistryCodec(schema_registry_url, topic, auto_register=False)
    newer = StreamMaker(seed=4).batch(events=6)
    produce(kafka_bootstrap, topic, [(b"old", old_message), (b"new", writer.encode_batch(newer))])
    with EventReader(kafka_bootstrap, topic, codec=RegistryCodec(schema_registry_url)) as reader:
        read = list(reader.batches(until_caught_up=True))
    assert reader.malformed_total == 0 and read == [batch, newer]
