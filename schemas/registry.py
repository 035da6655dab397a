"""The Confluent wire format with a schema registry: ``00`` + 4-byte big-endian schema id + body.

Use this instead of the default single-object framing when a Confluent-compatible schema
registry is part of the deployment: the registry then holds every schema version that ever
wrote to the topic, so readers resolve any of them without shipping schemas around, and the
registry's compatibility check guards the evolution rule (``schemas/avro/README.md``; configure
the subject as ``FULL_TRANSITIVE``).

The registry client comes from ``confluent-kafka[schemaregistry]`` (the ``registry`` extra) and
is imported only when a :class:`RegistryCodec` is created.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from . import _reference, codec
from ._avro import batch_schema_json, fingerprint_of, parse_for_codec
from .errors import DecodeError
from .model import EventBatch

if TYPE_CHECKING:
    from confluent_kafka.schema_registry import SchemaRegistryClient

__all__ = ["RegistryCodec"]

_HEADER = 5
_UNKNOWN = object()
_MAX_CACHED_IDS = 4096


def _client_from(registry: Any) -> SchemaRegistryClient:
    try:
        from confluent_kafka.schema_registry import SchemaRegistryClient
    except ImportError as exc:  # pragma: no cover - depends on the installed extras
        raise ImportError(
            "RegistryCodec needs the schema registry client: pip install 'kvevents[registry]'"
        ) from exc
    if isinstance(registry, str):
        registry = {"url": registry}
    if isinstance(registry, Mapping):
        conf = dict(registry)
        new_client = getattr(SchemaRegistryClient, "new_client", None)  # knows mock:// URLs
        registry = new_client(conf) if new_client is not None else SchemaRegistryClient(conf)
    client: SchemaRegistryClient = registry  # built here, or given ready-made
    return client


class RegistryCodec:
    """Encode and decode ``EventBatch`` messages in the Confluent wire format.

    ``registry`` is a ``SchemaRegistryClient``, its configuration (a mapping), or a URL
    (``mock://name`` gives confluent-kafka's in-memory registry, for tests). The schema is
    registered under ``subject``, by default ``<topic>-value`` (the registry's topic-name
    strategy), on first use; with ``auto_register=False`` it must already be registered and is
    only looked up. ``compatibility`` (such as ``"FULL_TRANSITIVE"``) is set on the subject at
    that point when given.

    Decoding looks the writer's schema up by id (once per id) and resolves it to the current
    schema when they differ; bodies written with the current schema take the fast path.
    Messages in the single-object framing are decoded as :func:`~kvevents.schemas.decode_batch`
    does, so a consumer reads both while producers switch.
    """

    def __init__(
        self,
        registry: Any,
        topic: str | None = None,
        *,
        subject: str | None = None,
        auto_register: bool = True,
        compatibility: str | None = None,
    ) -> None:
        self._client = _client_from(registry)
        self.subject = subject if subject is not None else (f"{topic}-value" if topic else None)
        self._auto_register = auto_register
        self._compatibility = compatibility
        self._schema_id: int | None = None
        self._header = b""
        self._writers: dict[int, Any] = {}
        self._single_object_header = codec.SINGLE_OBJECT_MAGIC + codec.current_fingerprint()

    # ------------------------------------------------------------------ writing

    @property
    def schema_id(self) -> int:
        """The registry id of the current ``EventBatch`` schema (registered on first use)."""
        if self._schema_id is None:
            self._schema_id = self._register()
            self._header = bytes([codec.CONFLUENT_MAGIC]) + self._schema_id.to_bytes(4, "big")
            self._writers[self._schema_id] = None  # None: the current schema, the fast path
        return self._schema_id

    def _register(self) -> int:
        from confluent_kafka.schema_registry import Schema

        if self.subject is None:
            raise ValueError("RegistryCodec needs a topic or a subject to register its schema under")
        schema = Schema(batch_schema_json(), "AVRO")
        if not self._auto_register:
            found = self._client.lookup_schema(self.subject, schema).schema_id
            if found is None:
                raise ValueError(f"the schema registry answered no schema id for subject {self.subject!r}")
            return int(found)
        if self._compatibility is not None:
            self._client.set_compatibility(self.subject, self._compatibility)
        return int(self._client.register_schema(self.subject, schema))

    def encode_batch(self, batch: EventBatch) -> bytes:
        """``batch`` as a Confluent wire-format message (``00``, schema id, Avro body)."""
        if self._schema_id is None:
            self.schema_id  # noqa: B018 - registers, which also builds the header
        return codec._BODY.encode_body(batch, self._header)

    # ------------------------------------------------------------------ reading

    def _writer(self, schema_id: int) -> Any:
        """None for the current schema, else the parsed writer schema; DecodeError if unknown."""
        try:
            writer = self._writers[schema_id]
        except KeyError:
            writer = self._fetch(schema_id)
            if len(self._writers) >= _MAX_CACHED_IDS:
                self._writers.clear()
            self._writers[schema_id] = writer
        if writer is _UNKNOWN:
            raise DecodeError(f"schema id {schema_id} is not in the schema registry")
        return writer

    def _fetch(self, schema_id: int) -> Any:
        from confluent_kafka.schema_registry.error import SchemaRegistryError

        try:
            schema = self._client.get_schema(schema_id)
        except SchemaRegistryError as exc:
            if exc.http_status_code == 404:
                return _UNKNOWN
            raise
        if (schema.schema_type or "AVRO") != "AVRO":
            raise DecodeError(f"schema id {schema_id} is a {schema.schema_type} schema, not Avro")
        try:
            parsed = parse_for_codec(schema.schema_str or "")
        except Exception as exc:
            raise DecodeError(f"schema id {schema_id} is not a readable Avro schema: {exc}") from exc
        return None if fingerprint_of(parsed) == codec.current_fingerprint() else parsed

    def _split(self, data: Any) -> tuple[memoryview | bytes | bytearray, Any]:
        view = codec._as_bytes_view(data)
        if len(view) < _HEADER:
            raise DecodeError(f"truncated: {len(view)} bytes is shorter than the 5-byte Confluent header")
        schema_id = int.from_bytes(view[1:_HEADER], "big")
        return view, self._writer(schema_id)

    def decode_batch(self, data: bytes | bytearray | memoryview) -> EventBatch:
        """Decode a Confluent wire-format (or single-object) message; DecodeError if malformed."""
        view = codec._as_bytes_view(data)
        if len(view) and view[0] != codec.CONFLUENT_MAGIC:
            return codec.decode_batch(view)
        view, writer = self._split(view)
        if writer is None:
            return codec._BODY.decode_body(view, _HEADER)
        return codec.decode_other_body(view, _HEADER, writer)

    def as_single_object(self, data: bytes | bytearray | memoryview) -> bytes | None:
        """A Confluent-framed message written with the current schema, re-framed as a
        single-object message (same body; for ``CacheIndex.apply_encoded``'s fast path); None
        for a message of another framing or schema version. DecodeError if malformed."""
        if (
            type(data) is bytes
            and len(data) >= _HEADER
            and data[0] == codec.CONFLUENT_MAGIC
            and self._writers.get(int.from_bytes(data[1:_HEADER], "big"), _UNKNOWN) is None
        ):
            return self._single_object_header + data[_HEADER:]  # the usual case, a known current id
        view = codec._as_bytes_view(data)
        if not len(view) or view[0] != codec.CONFLUENT_MAGIC:
            return None
        view, writer = self._split(view)
        if writer is not None:
            return None
        return self._single_object_header + bytes(memoryview(view)[_HEADER:])

    def decode_record(
        self, data: bytes | bytearray | memoryview, reader_schema: dict[str, Any] | str | None = None
    ) -> Any:
        """Decode into a plain Avro record resolved to ``reader_schema`` (see ``codec.decode_record``)."""
        view = codec._as_bytes_view(data)
        if len(view) and view[0] != codec.CONFLUENT_MAGIC:
            return codec.decode_record(view, reader_schema)
        view, writer = self._split(view)
        reader = codec._SCHEMA if reader_schema is None else parse_for_codec(reader_schema)
        return _reference.read_record(
            memoryview(view)[_HEADER:], codec._SCHEMA if writer is None else writer, reader
        )
