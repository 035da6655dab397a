"""Checkpoints in a compacted Kafka topic, cut into chunks, never loaded half-written.

Chunks first (two alternating slots), then a manifest once every chunk is acknowledged; a loader
uses a slot only if every chunk carries the manifest's id and the checksum holds. One writer per
name at a time. The scheme in detail: ``docs/INDEX.md``.
"""

from __future__ import annotations

import logging
import struct
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import msgspec
from confluent_kafka import KafkaError, Producer

from .checkpoint import Checkpoint, CheckpointError, decode_checkpoint, encode_checkpoint

__all__ = ["DEFAULT_CHUNK_BYTES", "KafkaCheckpointStore", "SavedCheckpoint", "checkpoint_topic_spec"]

log = logging.getLogger(__name__)

DEFAULT_CHUNK_BYTES = 900_000
"""Chunk size that fits Kafka's default ``max.message.bytes`` (1 MB) with room for the key,
the chunk header and the record framing."""
_CHUNK_HEADER = struct.Struct("<16sI")
_FRAMING_ROOM = 4096


class _Manifest(msgspec.Struct, frozen=True):
    id: bytes
    slot: str
    chunks: int
    size: int


@dataclass(frozen=True)
class SavedCheckpoint:
    """Where :meth:`KafkaCheckpointStore.save` put a checkpoint."""

    id: str
    slot: str
    chunks: int
    bytes: int


def checkpoint_topic_spec(name: str, *, max_message_bytes: int = 1_048_588) -> Any:
    """A ``kvevents.consumer.topics.TopicSpec`` for a checkpoint topic: one partition, compacted (and
    compacted soon: small segments, no minimum lag), ``max.message.bytes`` for the chunks."""
    from .topics import TopicSpec

    return TopicSpec(
        name,
        partitions=1,
        cleanup_policy="compact",
        max_message_bytes=max_message_bytes,
        configs={"segment.ms": "600000", "min.cleanable.dirty.ratio": "0.1", "delete.retention.ms": "600000"},
    )


class KafkaCheckpointStore:
    """Saves and loads checkpoints named ``name`` in the compacted topic ``topic``.

    ``chunk_bytes`` must fit the topic's ``max.message.bytes`` (less a few KB of framing);
    ``config`` goes to the producer and the reader (connection and security settings).
    """

    def __init__(
        self,
        bootstrap_servers: str,
        topic: str,
        *,
        name: str = "default",
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        config: Mapping[str, Any] | None = None,
        timeout_s: float = 60.0,
    ) -> None:
        if "/" in name or not name:
            raise ValueError(f"a checkpoint name is non-empty and has no '/', got {name!r}")
        if chunk_bytes < 1024:
            raise ValueError(f"chunk_bytes must be at least 1024, got {chunk_bytes}")
        self.bootstrap_servers = bootstrap_servers
        self.topic = topic
        self.name = name
        self.chunk_bytes = chunk_bytes
        self._config = dict(config or {})
        self._timeout = timeout_s
        self._manifest_key = f"{name}/manifest".encode()
        self._slot_chunks_seen: dict[str, int] = {}  # chunks each slot held, to delete leftovers
        self._current: _Manifest | None = None  # the latest manifest, once read or written
        self._current_known = False

    def create_topic(self, *, max_message_bytes: int | None = None) -> bool:
        """Create the compacted checkpoint topic (idempotent; an existing topic with other
        settings is an error naming them). Its ``max.message.bytes`` fits ``chunk_bytes``."""
        from .topics import create_topic

        limit = max_message_bytes or max(1_048_588, self.chunk_bytes + _CHUNK_HEADER.size + _FRAMING_ROOM)
        return create_topic(
            self.bootstrap_servers, checkpoint_topic_spec(self.topic, max_message_bytes=limit)
        )

    # ------------------------------------------------------------------ saving

    def save(self, checkpoint: Checkpoint) -> SavedCheckpoint:
        """Publish ``checkpoint``: chunks into the free slot, then the manifest. Raises
        :class:`CheckpointError` (and publishes no manifest) if a chunk is not delivered."""
        if not self._current_known:
            self._current = self._latest_manifest()
            self._current_known = True
        current = self._current
        slot = "b" if current is not None and current.slot == "a" else "a"
        data = encode_checkpoint(checkpoint)
        checkpoint_id = uuid.uuid4().bytes
        size = self.chunk_bytes
        chunks = max(1, -(-len(data) // size))
        producer = Producer(
            {
                **self._config,
                "bootstrap.servers": self.bootstrap_servers,
                "enable.idempotence": True,
                "acks": "all",
                "linger.ms": 5,
                "message.max.bytes": size + _CHUNK_HEADER.size + _FRAMING_ROOM,
                # one chunk per record batch: several in one batch could exceed max.message.bytes
                "batch.size": size + _CHUNK_HEADER.size + _FRAMING_ROOM,
            }
        )
        failures: list[str] = []

        def delivered(err: KafkaError | None, _msg: Any) -> None:
            if err is not None:
                failures.append(str(err))

        view = memoryview(data)
        for i in range(chunks):
            value = _CHUNK_HEADER.pack(checkpoint_id, i) + view[i * size : (i + 1) * size]
            self._produce(producer, f"{self.name}/{slot}/{i}".encode(), value, delivered)
        stale = 0 if current is None or current.slot != slot else current.chunks
        for i in range(chunks, max(stale, self._slot_chunks_seen.get(slot, 0))):
            self._produce(producer, f"{self.name}/{slot}/{i}".encode(), None, delivered)  # delete leftovers
        if producer.flush(self._timeout) or failures:
            raise CheckpointError(
                f"checkpoint {self.name!r} not saved to {self.topic!r}: chunks undelivered ({failures[:3] or 'timeout'})"
            )
        written = _Manifest(checkpoint_id, slot, chunks, len(data))
        self._produce(producer, self._manifest_key, msgspec.msgpack.encode(written), delivered)
        if producer.flush(self._timeout) or failures:
            raise CheckpointError(
                f"checkpoint {self.name!r}: manifest undelivered to {self.topic!r} ({failures[:3] or 'timeout'}); "
                "the previous checkpoint stays the latest"
            )
        self._slot_chunks_seen[slot] = chunks
        self._current = written
        return SavedCheckpoint(uuid.UUID(bytes=checkpoint_id).hex, slot, chunks, len(data))

    def _produce(self, producer: Producer, key: bytes, value: bytes | None, delivered: Any) -> None:
        while True:
            try:
                producer.produce(self.topic, value=value, key=key, on_delivery=delivered)
                return
            except BufferError:  # librdkafka's queue is full: let deliveries drain
                producer.poll(0.1)

    # ------------------------------------------------------------------ loading

    def _read_latest(self) -> tuple[_Manifest | None, dict[bytes, bytes | None]]:
        """Every key's latest value in the topic (for this name), and the latest manifest."""
        from .reader import EventReader, ReaderError

        prefix = f"{self.name}/".encode()
        latest: dict[bytes, bytes | None] = {}
        try:
            reader = EventReader(
                self.bootstrap_servers,
                self.topic,
                config=self._config,
                consume_batch=500,
                metadata_timeout_s=self._timeout,
            )
        except ReaderError as exc:
            raise CheckpointError(f"cannot read checkpoint topic {self.topic!r}: {exc}") from exc
        with reader:
            for message in reader.messages(until_caught_up=True, timeout=self._timeout):
                key = message.key()
                if key is not None and key.startswith(prefix):
                    latest[key] = message.value()
            if not reader.caught_up:
                raise CheckpointError(
                    f"checkpoint topic {self.topic!r}: not read to its end within {self._timeout} s"
                )
        raw = latest.get(self._manifest_key)
        if raw is None:
            return None, latest
        try:
            manifest = msgspec.msgpack.decode(raw, type=_Manifest)
        except msgspec.DecodeError as exc:
            raise CheckpointError(
                f"checkpoint {self.name!r} in {self.topic!r}: corrupt manifest ({exc})"
            ) from exc
        return manifest, latest

    def _latest_manifest(self) -> _Manifest | None:
        manifest, latest = self._read_latest()
        for key in latest:  # how many chunks each slot holds now, to delete leftovers
            parts = key.decode(errors="replace").split("/")
            if len(parts) == 3 and parts[2].isdigit() and latest[key] is not None:
                self._slot_chunks_seen[parts[1]] = max(
                    self._slot_chunks_seen.get(parts[1], 0), int(parts[2]) + 1
                )
        return manifest

    def load(self, *, topic: str | None = None) -> Checkpoint | None:
        """The latest complete checkpoint of this name (None if none was ever saved);
        ``topic``: require a checkpoint of that events topic. Raises :class:`CheckpointError`
        when the latest manifest's chunks are missing, mixed or corrupt."""
        manifest, latest = self._read_latest()
        if manifest is None:
            return None
        parts = []
        for i in range(manifest.chunks):
            value = latest.get(f"{self.name}/{manifest.slot}/{i}".encode())
            where = f"checkpoint {self.name!r} in {self.topic!r}, chunk {i} of {manifest.chunks}"
            if value is None or len(value) < _CHUNK_HEADER.size:
                raise CheckpointError(f"{where}: missing")
            chunk_id, index = _CHUNK_HEADER.unpack_from(value)
            if chunk_id != manifest.id or index != i:
                raise CheckpointError(f"{where}: belongs to another checkpoint (half-written or overwritten)")
            parts.append(memoryview(value)[_CHUNK_HEADER.size :])
        data = b"".join(parts)
        if len(data) != manifest.size:
            raise CheckpointError(
                f"checkpoint {self.name!r} in {self.topic!r}: {len(data)} bytes, the manifest says {manifest.size}"
            )
        return decode_checkpoint(data, topic=topic, source=f"checkpoint {self.name!r} in {self.topic!r}")
