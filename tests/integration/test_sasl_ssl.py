"""The local broker and the pipeline over SASL_SSL: a self-signed certificate made now
(keytool), SASL/PLAIN users with random passwords; the Kafka sink and the EventReader move
events through it, ``kvevents index`` reads it with its credentials from a file named by
``$KVEVENTS_KAFKA_CONFIG``, and no password shows up in any output, -v or error alike."""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from confluent_kafka.admin import AdminClient, NewTopic
from kvevents.consumer import CacheIndex, EventReader
from kvevents.producer import BlockInfo, KafkaEventSink, KVCacheEventManager

from kvevents.broker import LocalBroker
from kvevents.broker.config import DEFAULT_HOST, free_port
from kvevents.broker.probe import metadata_answers
from kvevents.broker.security import SaslSslListener, make_self_signed_tls

pytestmark = [pytest.mark.kafka, pytest.mark.slow]

USER = "kvevents"


@dataclass
class SecureBroker:
    bootstrap: str
    listener: SaslSslListener
    passwords: list[str]

    def client(self, password: str | None = None) -> dict[str, str]:
        return {"bootstrap.servers": self.bootstrap, **self.listener.client_config(USER, password)}


@pytest.fixture(scope="module")
def secure_broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SecureBroker]:
    root = tmp_path_factory.mktemp("sasl-ssl")
    tls = make_self_signed_tls(root / "tls")
    users = {"broker": secrets.token_urlsafe(16), USER: secrets.token_urlsafe(16)}
    listener = SaslSslListener(tls, users)
    client_port = free_port()
    controller_port = free_port(exclude=frozenset({client_port}))
    broker = LocalBroker(
        root / "broker",
        port=client_port,
        controller_port=controller_port,
        extra_properties=listener.broker_properties(DEFAULT_HOST, client_port, controller_port),
        client_config=listener.client_config(USER),
        stop_with_parent=True,
    )
    broker.start()
    try:
        assert (broker.layout.server_properties.stat().st_mode & 0o077) == 0  # holds passwords
        yield SecureBroker(broker.bootstrap_servers, listener, [*users.values(), tls.password])
    finally:
        broker.stop()


def make_topic(broker: SecureBroker, name: str) -> str:
    admin = AdminClient(broker.client())
    for future in admin.create_topics([NewTopic(name, num_partitions=1, replication_factor=1)]).values():
        future.result(30)
    return name


def test_plaintext_and_wrong_passwords_are_refused(secure_broker: SecureBroker) -> None:
    assert metadata_answers(secure_broker.bootstrap, 5.0, secure_broker.listener.client_config(USER))
    assert not metadata_answers(secure_broker.bootstrap, 3.0)  # PLAINTEXT on the SASL_SSL port
    assert not metadata_answers(
        secure_broker.bootstrap, 3.0, secure_broker.listener.client_config(USER, "wrong")
    )


def test_the_sink_and_the_reader_move_events_over_sasl_ssl(secure_broker: SecureBroker) -> None:
    topic = make_topic(secure_broker, f"sasl-pipeline-{secrets.token_hex(4)}")
    client = secure_broker.listener.client_config(USER)
    manager = KVCacheEventManager(10_000)
    sink = KafkaEventSink(
        manager, topic, "secure-0", config={"bootstrap.servers": secure_broker.bootstrap, **client}
    )
    for i in range(1, 201):
        manager.enqueue_stored_event([BlockInfo(i, None, (i, i + 1))], 64)
        manager.flush()
    manager.close()
    report = sink.close(timeout=30)
    assert sink.stats().events_delivered_total == 200 and not report.unreported_by_rank

    index = CacheIndex()
    with EventReader(secure_broker.bootstrap, topic, config=client) as reader:
        read = reader.apply_to(index)
    assert read.events == 200 and read.malformed == 0
    assert index.held_blocks() == 200 and not index.degraded_workers()


def run_index(
    secure_broker: SecureBroker, topic: str, config_file: Path, *flags: str
) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, KVEVENTS_KAFKA_CONFIG=str(config_file))
    env.pop("KAFKA_BOOTSTRAP_SERVERS", None)
    return subprocess.run(
        [sys.executable, "-m", "kvevents.cli", "index", "-b", secure_broker.bootstrap, "-t", topic, *flags],
        capture_output=True, text=True, env=env, timeout=120,
    )  # fmt: skip


def write_config(path: Path, settings: dict[str, str]) -> Path:
    path.write_text("# kvevents client settings\n" + "".join(f"{k}={v}\n" for k, v in settings.items()))
    path.chmod(0o600)
    return path


def test_the_cli_takes_credentials_from_a_file_and_never_prints_them(
    secure_broker: SecureBroker, tmp_path: Path
) -> None:
    topic = make_topic(secure_broker, f"sasl-cli-{secrets.token_hex(4)}")
    manager = KVCacheEventManager(1000)
    sink = KafkaEventSink(manager, topic, "cli-0", config=secure_broker.client())
    manager.enqueue_stored_event([BlockInfo(7, None, (1, 2, 3))], 64)
    manager.close()
    sink.close(timeout=30)

    good = write_config(tmp_path / "client.properties", secure_broker.listener.client_config(USER))
    ok = run_index(secure_broker, topic, good, "--json", "-vv")
    assert ok.returncode == 0, ok.stderr[-3000:]
    assert '"events": 1' in ok.stdout or '"events":1' in ok.stdout, ok.stdout[-2000:]
    wrong_password = "not-" + secrets.token_urlsafe(12)
    bad = write_config(
        tmp_path / "bad.properties", secure_broker.listener.client_config(USER, wrong_password)
    )
    refused = run_index(secure_broker, topic, bad, "-v")
    assert refused.returncode != 0
    assert "Authentication failed" in refused.stderr  # the reason, not the secret
    for output in (ok.stdout, ok.stderr, refused.stdout, refused.stderr):
        for secret in (*secure_broker.passwords, wrong_password):
            assert secret not in output
