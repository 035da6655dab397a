"""TensorRT-LLM in: its event dicts (``LLM.get_kv_cache_events()``, ``trtllm-serve``'s
``POST /kv_cache_events``) as kvevents events, and pumps that feed them to a Kafka sink.

:func:`event_from_trtllm` maps one dict, every type and field, old and new versions: hashes as
ints (``size_t``, either sign) or hex digests (``v2_sha256``: first 8 bytes, big endian), tokens
as ``unique_token`` maps or plain ints (the V2 manager's hex digest of a multimodal item, written
as a token id, as :data:`~kvevents.schemas.WIDE_TOKEN_ID` with the digest in its extra id),
``mm_keys`` as ``mm_key`` maps or pairs (their hash a hex digest or a user-given UUID),
``lora_id`` (or a ``lora_name``, as the ZMQ bridge reads vLLM's) and ``cache_salt`` when present. Event ids and ``attention_dp_rank`` pass through
unchanged, so TensorRT-LLM's own drops show as id gaps. A dict that cannot be read raises
:class:`TrtllmDecodeError` naming the field.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import urllib.error
import urllib.request
from array import array
from collections import Counter
from collections.abc import Callable, Iterable
from typing import Any

from kvevents.schemas import (
    WIDE_TOKEN_ID,
    DecodeError,
    KVCacheCreatedData,
    KVCacheEvent,
    KVCacheEventDiff,
    KVCacheRemovedData,
    KVCacheStoredBlockData,
    KVCacheStoredData,
    KVCacheUpdatedData,
    RankDrops,
)

from kvevents._brief import brief

from .bridge.hashes import lora_id_for_name
from .buffer import EventDrain
from .mm_keys import digest_from_hex, mm_key_from_text

__all__ = [
    "TrtllmDecodeError",
    "TrtllmEventSource",
    "event_from_trtllm",
    "poll_trtllm_serve",
]

log = logging.getLogger(__name__)
_U64 = (1 << 64) - 1
_I64_MAX = (1 << 63) - 1  # the schema's long and int: a value past them is set aside here, by name,
_I32_MAX = (1 << 31) - 1  # not found unencodable later by the sink
_DEFAULT_PRIORITY = 35


class TrtllmDecodeError(DecodeError):
    """A TensorRT-LLM event dict that cannot be read; the message names the field."""


def event_from_trtllm(d: dict[str, Any]) -> KVCacheEvent:
    """One TensorRT-LLM event dict as a :class:`KVCacheEvent`."""
    if not isinstance(d, dict):
        raise TrtllmDecodeError(f"an event must be a dict, got {type(d).__name__}")
    event_id = _int(d.get("event_id"), "event_id", 0, _I64_MAX)
    if event_id is None:
        raise TrtllmDecodeError("event has no event_id")
    window = _int(d.get("window_size", 0), "window_size", 0, _I32_MAX) or 0
    rank = _int(d.get("attention_dp_rank"), "attention_dp_rank", 0, _I32_MAX)
    data = d.get("data")
    if not isinstance(data, dict):
        raise TrtllmDecodeError(f"data must be a dict, got {type(data).__name__}")
    return KVCacheEvent(event_id, _data(data, d.get("hash_algo")), window, rank)


def _data(data: dict[str, Any], hash_algo: object) -> Any:
    kind = data.get("type")
    if kind == "created":
        levels = data.get("num_blocks_per_cache_level")
        if not isinstance(levels, list):
            raise TrtllmDecodeError("data.num_blocks_per_cache_level must be a list")
        return KVCacheCreatedData(
            [_req_int(v, f"data.num_blocks_per_cache_level[{i}]", 0, _I32_MAX) for i, v in enumerate(levels)]
        )
    if kind == "stored":
        blocks = data.get("blocks")
        if not isinstance(blocks, list):
            raise TrtllmDecodeError("data.blocks must be a list")
        parent = data.get("parent_hash")
        lora_name = _lora_name(data.get("lora_name"), "data.lora_name")
        return KVCacheStoredData(
            None if parent is None else _hash(parent, "data.parent_hash"),
            [_block(b, f"data.blocks[{i}]", lora_name) for i, b in enumerate(blocks)],
        )
    if kind == "removed":
        hashes = data.get("block_hashes")
        if not isinstance(hashes, list):
            raise TrtllmDecodeError("data.block_hashes must be a list")
        return KVCacheRemovedData([_hash(h, f"data.block_hashes[{i}]") for i, h in enumerate(hashes)])
    if kind == "updated":
        if "block_hash" not in data:
            raise TrtllmDecodeError("data.block_hash is missing")
        return KVCacheUpdatedData(
            _hash(data["block_hash"], "data.block_hash"),
            cache_level=_diff(data.get("cache_level"), "data.cache_level"),
            priority=_diff(data.get("priority"), "data.priority"),
        )
    raise TrtllmDecodeError(f"data.type {brief(kind)} is not created/stored/removed/updated")


def _lora_name(name: object, where: str) -> str | None:
    if name is None or isinstance(name, str):
        return name or None
    raise TrtllmDecodeError(f"{where} must be a string or null, got {brief(name)}")


def _block(b: object, where: str, lora_name: str | None = None) -> KVCacheStoredBlockData:
    """One stored block; without a ``lora_id``, a LoRA ``lora_name`` (the block's, or the
    event's, as Dynamo's TensorRT-LLM publisher reads it) gives the stable id the ZMQ bridge
    gives vLLM's adapters (:func:`~kvevents.producer.bridge.hashes.lora_id_for_name`)."""
    if not isinstance(b, dict):
        raise TrtllmDecodeError(f"{where} must be a dict, got {type(b).__name__}")
    if "block_hash" not in b:
        raise TrtllmDecodeError(f"{where}.block_hash is missing")
    tokens_raw = b.get("tokens", [])
    if not isinstance(tokens_raw, list):
        raise TrtllmDecodeError(f"{where}.tokens must be a list")
    tokens: list[int] = []
    extras: list[int] = []
    for i, t in enumerate(tokens_raw):
        token_id, extra = _token(t, f"{where}.tokens[{i}]")
        tokens.append(token_id)
        extras.append(extra)
    lora = b.get("lora_id")
    if lora is None:
        name = _lora_name(b.get("lora_name"), f"{where}.lora_name") or lora_name
        lora = None if name is None else lora_id_for_name(name)
    salt = b.get("cache_salt")
    mm_keys = b.get("mm_keys") or []
    if not isinstance(mm_keys, list):
        raise TrtllmDecodeError(f"{where}.mm_keys must be a list")
    return KVCacheStoredBlockData(
        block_hash=_hash(b["block_hash"], f"{where}.block_hash"),
        tokens=array("i", tokens),
        lora_id=None if lora is None else _req_int(lora, f"{where}.lora_id", -(1 << 63), _U64) & _U64,
        cache_level=_req_int(b.get("cache_level", 0), f"{where}.cache_level", 0, _I32_MAX),
        priority=_req_int(b.get("priority", _DEFAULT_PRIORITY), f"{where}.priority", 0, _I32_MAX),
        token_extra_ids=array("Q", extras) if any(extras) else None,
        mm_keys=tuple(_mm_key(k, f"{where}.mm_keys[{i}]") for i, k in enumerate(mm_keys)),
        cache_salt=None if salt is None else _salt(salt, f"{where}.cache_salt"),
    )


def _token(t: object, where: str) -> tuple[int, int]:
    """A token (a ``unique_token`` map or a plain id) as its id and extra id. A multimodal
    item's content digest, which TensorRT-LLM's V2 manager writes in hex where the item's first
    token goes, becomes (:data:`~kvevents.schemas.WIDE_TOKEN_ID`, the digest's first 8 bytes,
    big endian)."""
    extra = 0
    if isinstance(t, dict):
        raw_extra = t.get("token_extra_id", 0)
        if raw_extra is not None:
            extra = _req_int(raw_extra, f"{where}.token_extra_id", 0, _U64)
        where, t = f"{where}.token_id", t.get("token_id")
    if not isinstance(t, str):
        return _req_int(t, where, -(1 << 31), _I32_MAX), extra
    digest = digest_from_hex(t)
    if digest is None:
        raise TrtllmDecodeError(f"{where} must be an int or a 64-digit hex digest, got {t[:80]!r}")
    if extra:
        raise TrtllmDecodeError(
            f"{where} is a multimodal digest with token_extra_id {extra}: TensorRT-LLM writes 0"
        )
    return WIDE_TOKEN_ID, int.from_bytes(digest[:8], "big")


def _salt(value: object, where: str) -> str:
    """The salt as text (a number as its digits); a string that UTF-8 cannot carry is refused."""
    text = str(value)
    try:
        text.encode()
    except UnicodeEncodeError:
        raise TrtllmDecodeError(f"{where} is not valid UTF-8 text (a lone surrogate)") from None
    return text


def _mm_key(key: object, where: str) -> tuple[bytes, int]:
    if isinstance(key, dict):
        raw, offset = key.get("hash"), key.get("start_offset", 0)
    elif isinstance(key, (list, tuple)) and len(key) == 2:
        raw, offset = key
    else:
        raise TrtllmDecodeError(f"{where} must be a mm_key dict or a (hash, offset) pair")
    if isinstance(raw, str):
        raw = _mm_hash_text(raw, f"{where}.hash")
    elif isinstance(raw, list):
        raw = bytes(_req_int(x, f"{where}.hash", 0, 255) for x in raw)
    if not isinstance(raw, (bytes, bytearray)) or len(raw) != 32:
        raise TrtllmDecodeError(f"{where}.hash must be 32 bytes")
    return bytes(raw), _req_int(offset, f"{where}.start_offset", 0, _I32_MAX)


def _mm_hash_text(text: str, where: str) -> bytes:
    """A multimodal item's key from its JSON text: a 32-byte hex digest, or (TensorRT-LLM with
    user-given ``multimodal_uuids``) the UUID itself, which the serializer writes in place of
    the digest (:func:`~kvevents.producer.mm_keys.mm_key_from_text`)."""
    try:
        return mm_key_from_text(text)
    except UnicodeEncodeError:
        raise TrtllmDecodeError(f"{where} is neither a hex digest nor UTF-8 text") from None


def _diff(value: object, where: str) -> KVCacheEventDiff | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise TrtllmDecodeError(f"{where} must be an event_diff dict or null")
    return KVCacheEventDiff(
        _req_int(value.get("old_value"), f"{where}.old_value", -(1 << 31), _I32_MAX),
        _req_int(value.get("new_value"), f"{where}.new_value", -(1 << 31), _I32_MAX),
    )


def _hash(value: object, where: str) -> int:
    if isinstance(value, bool):
        raise TrtllmDecodeError(f"{where} must be an int or a hex digest, got a bool")
    if isinstance(value, int):
        if not -(1 << 63) <= value <= _U64:
            raise TrtllmDecodeError(f"{where}: {brief(value)} does not fit in 64 bits")
        return value & _U64
    if isinstance(value, str):
        try:
            raw = bytes.fromhex(value.removeprefix("0x"))
        except ValueError:
            raise TrtllmDecodeError(f"{where}: {value[:80]!r} is not a hex digest") from None
        if not raw:
            raise TrtllmDecodeError(f"{where} is empty")
        return int.from_bytes(raw[:8], "big")
    raise TrtllmDecodeError(f"{where} must be an int or a hex digest, got {type(value).__name__}")


def _int(value: object, where: str, minimum: int | None = None, maximum: int | None = None) -> int | None:
    if value is None:
        return None
    return _req_int(value, where, minimum, maximum)


def _req_int(value: object, where: str, minimum: int | None = None, maximum: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TrtllmDecodeError(f"{where} must be an int, got {brief(value)}")
    if (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
        raise TrtllmDecodeError(f"{where}: {brief(value)} is out of range")
    return value


class TrtllmEventSource:
    """An ``EventSource`` for ``KafkaEventSink`` fed by a TensorRT-LLM event fetcher.

    ``fetch(timeout)`` returns a list of event dicts (``LLM.get_kv_cache_events`` or
    :func:`poll_trtllm_serve`). A background thread calls it, maps each dict and keeps at most
    ``max_events`` events (oldest dropped, counted per rank). Dicts that cannot be read are
    counted (``stats()``) and set aside in ``rejected`` (the last 100), never fatal.
    """

    def __init__(
        self,
        fetch: Callable[[float], Iterable[dict[str, Any]] | None],
        *,
        attention_dp_size: int | None = None,
        max_events: int = 1_000_000,
        fetch_timeout: float = 0.5,
        idle_sleep: float = 0.0,
    ) -> None:
        self._fetch = fetch
        self._dp_size = attention_dp_size
        self._max = max_events
        self._timeout = fetch_timeout
        self._idle_sleep = idle_sleep
        self._events: list[KVCacheEvent] = []
        self._dropped: Counter[int] = Counter()
        self._cond = threading.Condition()
        self._closed = False
        self.counts: Counter[str] = Counter()
        self.rejected: list[tuple[str, Any]] = []
        self._thread = threading.Thread(target=self._run, name="kvevents-trtllm-pump", daemon=True)
        self._thread.start()

    @property
    def attention_dp_size(self) -> int | None:
        return self._dp_size

    @property
    def closed(self) -> bool:
        with self._cond:
            return self._closed and not self._events and not self._dropped

    def stats(self) -> dict[str, int]:
        with self._cond:
            return dict(self.counts)

    def drain(self, timeout: float | None = None) -> EventDrain:
        with self._cond:
            if not self._events and not self._dropped and not self._closed:
                self._cond.wait(timeout)
            events, self._events = self._events, []
            dropped = [RankDrops(r, n) for r, n in sorted(self._dropped.items())]
            self._dropped.clear()
        return EventDrain(events, dropped)

    def close(self, timeout: float = 5.0) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout)

    def _run(self) -> None:
        while True:
            with self._cond:
                if self._closed:
                    return
            try:
                batch = self._fetch(self._timeout)
            except Exception as exc:  # noqa: BLE001 (the engine call failing must not stop the pump)
                with self._cond:
                    self.counts["fetch_errors"] += 1
                log.warning("fetching TensorRT-LLM events failed: %s", exc)
                time.sleep(min(1.0, self._timeout or 0.1))
                continue
            self._accept(batch or [])
            if not batch and self._idle_sleep:
                time.sleep(self._idle_sleep)

    def _accept(self, batch: Iterable[dict[str, Any]]) -> None:
        converted: list[KVCacheEvent] = []
        bad: list[tuple[str, Any]] = []
        for d in batch:
            if isinstance(d, dict) and not d:
                continue  # TensorRT-LLM serializes a missing event as {}
            try:
                converted.append(event_from_trtllm(d))
            except DecodeError as exc:
                bad.append((str(exc), d))
        with self._cond:
            self.counts["events"] += len(converted)
            if bad:
                self.counts["rejected"] += len(bad)
                self.rejected = (self.rejected + bad)[-100:]
                for message, _ in bad:
                    log.warning("TensorRT-LLM event set aside: %s", message)
            self._events.extend(converted)
            overflow = len(self._events) - self._max
            if overflow > 0:
                for event in self._events[:overflow]:
                    self._dropped[event.attention_dp_rank or 0] += 1
                del self._events[:overflow]
                self.counts["dropped"] += overflow
            if converted or bad:
                self._cond.notify_all()


def poll_trtllm_serve(url: str, *, http_timeout: float = 10.0) -> Callable[[float], list[dict[str, Any]]]:
    """A fetcher for :class:`TrtllmEventSource` that POSTs ``trtllm-serve``'s ``/kv_cache_events``."""
    endpoint = url.rstrip("/")
    if not endpoint.endswith("/kv_cache_events"):
        endpoint += "/kv_cache_events"

    def fetch(timeout: float) -> list[dict[str, Any]]:
        request = urllib.request.Request(
            endpoint, data=b"", method="POST", headers={"content-type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=http_timeout + timeout) as response:
            body = response.read()
        decoded = json.loads(body) if body.strip() else []
        if decoded is None:
            return []
        if not isinstance(decoded, list):
            raise TrtllmDecodeError(f"{endpoint} answered a {type(decoded).__name__}, expected a JSON list")
        return decoded

    return fetch
