"""-F FILE, -X and the schema registry settings of the Kafka commands (no broker)."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from kvevents.commands._common import (
    CommandError,
    add_kafka_flags,
    kafka_config,
    reader_codec,
    registry_settings,
    resolve_bootstrap,
    writer_codec,
)
from kvevents.commands._kafka_setup import read_properties, split_settings


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_kafka_flags(parser)
    return parser.parse_args(list(argv))


def test_properties_file_then_x_settings_a_later_one_wins(tmp_path: Path) -> None:
    props = tmp_path / "c.properties"
    props.write_text("# comment\n! also a comment\n\nclient.id = from-file\nlinger.ms=5\nsasl.password=a=b\n")
    args = _args("-F", str(props), "-X", "linger.ms=7")
    assert kafka_config(args) == {"client.id": "from-file", "linger.ms": "7", "sasl.password": "a=b"}


def test_a_bad_properties_line_names_file_and_line(tmp_path: Path) -> None:
    props = tmp_path / "bad.properties"
    props.write_text("client.id=x\nno equals sign here\n")
    with pytest.raises(ValueError, match=r"bad.properties:2: expected KEY=VALUE"):
        read_properties(props)
    with pytest.raises(CommandError, match=r"bad\.properties:2"):
        kafka_config(_args("-F", str(props)))
    with pytest.raises(CommandError, match="cannot read the properties file"):
        kafka_config(_args("-F", str(tmp_path / "missing.properties")))


def test_registry_settings_are_kept_away_from_librdkafka(tmp_path: Path) -> None:
    kafka, registry = split_settings(
        [
            ("bootstrap.servers", "k:9092"),
            ("schema.registry.url", "http://r:8081"),
            ("basic.auth.credentials.source", "USER_INFO"),
            ("basic.auth.user.info", "alice:secret"),
            ("schema.registry.ssl.ca.location", "/ca.pem"),
        ]
    )
    assert kafka == {"bootstrap.servers": "k:9092"}
    assert registry == {
        "url": "http://r:8081",
        "basic.auth.user.info": "alice:secret",
        "ssl.ca.location": "/ca.pem",
    }


def test_url_flag_over_file_and_credentials_reach_the_client(tmp_path: Path) -> None:
    props = tmp_path / "c.properties"
    props.write_text("schema.registry.url=http://from-file:1\nbasic.auth.user.info=alice:secret\n")
    args = _args("-F", str(props), "--schema-registry-url", "mock://cli-settings")
    assert registry_settings(args) == {"url": "mock://cli-settings", "basic.auth.user.info": "alice:secret"}
    assert kafka_config(args) == {}
    codec = writer_codec(args, "events")
    assert codec is not None and codec.subject == "events-value"
    assert reader_codec(args) is not None


def test_no_registry_means_single_object_framing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVEVENTS_SCHEMA_REGISTRY_URL", raising=False)
    assert registry_settings(_args()) is None and reader_codec(_args()) is None
    monkeypatch.setenv("KVEVENTS_SCHEMA_REGISTRY_URL", "mock://from-env")
    assert registry_settings(_args()) == {"url": "mock://from-env"}


def test_registry_credentials_without_a_url_are_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVEVENTS_SCHEMA_REGISTRY_URL", raising=False)
    with pytest.raises(CommandError, match="without a URL"):
        registry_settings(_args("-X", "basic.auth.user.info=a:b"))


def test_basic_auth_from_the_properties_file_goes_over_the_wire(tmp_path: Path) -> None:
    """The registry client sends -F's basic.auth.user.info as HTTP basic auth (a loopback server
    standing in for the registry records the header and answers 404: unknown schema id)."""
    import base64
    import threading
    from http.server import BaseHTTPRequestHandler, HTTPServer

    from kvevents.schemas import DecodeError

    seen: list[str | None] = []

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            seen.append(self.headers.get("Authorization"))
            body = b'{"error_code": 40403, "message": "Schema not found"}'
            self.send_response(404)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = HTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        props = tmp_path / "c.properties"
        url = f"http://127.0.0.1:{server.server_address[1]}"
        props.write_text(f"schema.registry.url={url}\nbasic.auth.user.info=alice:secret\n")
        codec = reader_codec(_args("-F", str(props)))
        with pytest.raises(DecodeError, match="schema id 7 is not in the schema registry"):
            codec.decode_batch(b"\x00\x00\x00\x00\x07body")
    finally:
        server.shutdown()
        server.server_close()
    assert seen and seen[0] == "Basic " + base64.b64encode(b"alice:secret").decode()


def test_the_kafka_address_comes_from_the_flag_then_the_properties_file_then_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As kcat reads it: a properties file's bootstrap.servers is the address unless
    --bootstrap-servers is given, and it comes before $KAFKA_BOOTSTRAP_SERVERS (the file was
    named on purpose). A file that cannot be read says so, before any 'no Kafka address'."""
    props = tmp_path / "client.properties"
    props.write_text("bootstrap.servers = kafka-a:9092\nsecurity.protocol=SSL\n")
    monkeypatch.setenv("KAFKA_BOOTSTRAP_SERVERS", "from-env:9092")
    assert resolve_bootstrap(_args("-F", str(props))) == "kafka-a:9092"
    assert resolve_bootstrap(_args("-F", str(props), "-b", "flag:9092")) == "flag:9092"
    assert resolve_bootstrap(_args("-X", "bootstrap.servers=x:1")) == "x:1"
    assert resolve_bootstrap(_args()) == "from-env:9092"
    with pytest.raises(CommandError, match="cannot read the properties file"):
        resolve_bootstrap(_args("-F", str(tmp_path / "missing.properties")))
