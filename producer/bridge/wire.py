"""Reading one vLLM/SGLang ZMQ payload (msgpack) into plain records, whatever its shape.

Decoded generically with msgspec, then interpreted by type rather than position alone:

- batch: ``[ts, events]``, ``[ts, events, dp_rank]`` or a map ``{ts, events, data_parallel_rank |
  attn_dp_rank}``;
- events: arrays with the tag first (older releases; trailing fields may be missing) or maps
  with a ``"type"`` key (vLLM after #42892, SGLang 0.5.2x);
- position 7 of an array ``BlockStored``: ``lora_name`` (vLLM, a string) or a map
  (SGLang: ``cache_salt`` ...), also accepted as ``"metadata"`` in maps.

Unknown event tags and fields are counted in :class:`WireCounts` and skipped; anything that cannot
be read raises :class:`BridgeDecodeError` naming the field. This is the tolerant path: the common
shapes are read first by typed decoding (:mod:`.fastwire`), which falls back here on any mismatch.
"""

from __future__ import annotations

from array import array
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import msgspec
from kvevents.schemas import WIDE_TOKEN_ID, DecodeError

from kvevents._brief import brief

from .hashes import U64_MASK, WireError, fold_hash

__all__ = [
    "BridgeDecodeError",
    "ParsedBatch",
    "RawRemoved",
    "RawStored",
    "WireCounts",
    "parse_payload",
]

STORED_FIELDS = (
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
    "extra_keys",
    "group_idx",
    "kv_cache_spec_kind",
    "kv_cache_spec_sliding_window",
)
REMOVED_FIELDS = ("block_hashes", "medium", "group_idx")
_PLACEMENT_FIELDS = frozenset({"locality", "ownership"})  # vLLM: where the block is, whose cache
_STORED_EXTRA_MAP_FIELDS = frozenset({"cache_salt", "session_id", "metadata", "type"}) | _PLACEMENT_FIELDS
_STORED_MAP_KEYS = frozenset(STORED_FIELDS) | _STORED_EXTRA_MAP_FIELDS
_REMOVED_MAP_KEYS = frozenset({*REMOVED_FIELDS, "type"}) | _PLACEMENT_FIELDS
_METADATA_FIELDS = frozenset({"cache_salt", "session_id", "lora_name", "lora_id"})
_BATCH_RANK_KEYS = ("data_parallel_rank", "attn_dp_rank", "dp_rank")

_decoder = msgspec.msgpack.Decoder()


class BridgeDecodeError(DecodeError):
    """A ZMQ payload that is not a readable vLLM/SGLang event batch; the message says why."""


COUNT_NAME_CHARS = 64
COUNT_NAMES = 256


@dataclass(slots=True)
class WireCounts:
    """What was skipped while reading: unknown event tags, unknown fields (by name), and events
    about blocks not on this worker or in another owner's cache (``not_local``, by reason)."""

    unknown_tags: Counter[str] = field(default_factory=Counter)
    unknown_fields: Counter[str] = field(default_factory=Counter)
    not_local: Counter[str] = field(default_factory=Counter)

    def merge(self, other: WireCounts) -> None:
        """Add ``other``'s counts (one payload's), each name cut to ``COUNT_NAME_CHARS`` and at
        most ``COUNT_NAMES`` names per counter, the rest under ``"(other names)"``: a stream of
        ever new field names grew these without bound (400k of them: +119 MB)."""
        for mine, theirs in (
            (self.unknown_tags, other.unknown_tags),
            (self.unknown_fields, other.unknown_fields),
            (self.not_local, other.not_local),
        ):
            for name, n in theirs.items():
                name = name[:COUNT_NAME_CHARS]
                if name not in mine and len(mine) >= COUNT_NAMES:
                    name = "(other names)"
                mine[name] += n

    def as_dict(self) -> dict[str, dict[str, int]]:
        return {
            "unknown_tags": dict(self.unknown_tags),
            "unknown_fields": dict(self.unknown_fields),
            "not_local": dict(self.not_local),
        }


@dataclass(slots=True)
class RawStored:
    block_hashes: list[int]
    parent: int | None
    token_ids: array[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[Any] | None
    group_idx: int | None
    spec_kind: str | None
    sliding_window: int | None
    cache_salt: str | None
    token_extra_ids: array[int] | None = None
    """Per token, the value of a token wider than 32 bits (its id is ``WIDE_TOKEN_ID``), else 0;
    None when every token fits."""
    token_pairs: bool = False
    """The token ids came as (token, next token) pairs (SGLang's bigram keys with EAGLE)."""


@dataclass(slots=True)
class RawRemoved:
    block_hashes: list[int]
    medium: str | None
    group_idx: int | None


class RawCleared:
    pass


RawEvent = RawStored | RawRemoved | RawCleared


@dataclass(slots=True)
class ParsedBatch:
    ts: float | None
    dp_rank: int | None
    events: list[RawEvent]


def parse_payload(payload: bytes, *, take_last: bool, counts: WireCounts) -> ParsedBatch:
    """Read one payload; raises :class:`BridgeDecodeError`. ``take_last``: how digests fold."""
    if not isinstance(payload, (bytes, bytearray, memoryview)):
        raise BridgeDecodeError(f"payload must be bytes, got {type(payload).__name__}")
    try:
        obj = _decoder.decode(payload)
    except (msgspec.DecodeError, ValueError) as exc:
        raise BridgeDecodeError(f"payload is not msgpack: {exc}") from None
    except RecursionError:
        raise BridgeDecodeError("payload is not an event batch: msgpack nested too deeply") from None
    if isinstance(obj, dict):
        ts, events, rank = obj.get("ts"), obj.get("events"), None
        for key in _BATCH_RANK_KEYS:
            if obj.get(key) is not None:
                rank = obj[key]
                break
        for key in obj:
            if key not in ("ts", "events", *_BATCH_RANK_KEYS):
                counts.unknown_fields[f"batch.{key}"] += 1
        if "events" not in obj:
            raise BridgeDecodeError("batch map has no 'events'")
    elif isinstance(obj, list):
        if len(obj) < 2:
            raise BridgeDecodeError(f"batch array has {len(obj)} fields, expected [ts, events(, dp_rank)]")
        ts, events = obj[0], obj[1]
        rank = obj[2] if len(obj) > 2 else None
        for _ in obj[3:]:
            counts.unknown_fields["batch[3+]"] += 1
    else:
        raise BridgeDecodeError(f"batch must be an array or a map, got {type(obj).__name__}")
    if ts is not None and (isinstance(ts, bool) or not isinstance(ts, (int, float))):
        raise BridgeDecodeError(f"batch.ts must be a number, got {type(ts).__name__}")
    if not isinstance(events, list):
        raise BridgeDecodeError(f"batch.events must be an array, got {type(events).__name__}")
    if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int) or rank < 0):
        raise BridgeDecodeError(f"batch dp rank must be an int >= 0, got {brief(rank)}")
    parsed: list[RawEvent] = []
    for i, event in enumerate(events):
        try:
            raw = _parse_event(event, take_last, counts, f"events[{i}]")
        except WireError as exc:
            raise BridgeDecodeError(str(exc)) from None
        if raw is not None:
            parsed.append(raw)
    return ParsedBatch(None if ts is None else float(ts), rank, parsed)


def _parse_event(event: object, take_last: bool, counts: WireCounts, where: str) -> RawEvent | None:
    if isinstance(event, list):
        if not event or not isinstance(event[0], str):
            raise WireError(f"{where}: an array event must start with its tag (a string)")
        tag, values = event[0], event[1:]
        if tag == "BlockStored":
            fields = dict(zip(STORED_FIELDS, values, strict=False))
            if len(values) > len(STORED_FIELDS):
                counts.unknown_fields[f"BlockStored[{len(STORED_FIELDS) + 1}+]"] += 1
            return _stored(fields, take_last, counts, where)
        if tag == "BlockRemoved":
            fields = dict(zip(REMOVED_FIELDS, values, strict=False))
            if len(values) > len(REMOVED_FIELDS):
                counts.unknown_fields[f"BlockRemoved[{len(REMOVED_FIELDS) + 1}+]"] += 1
            return _removed(fields, take_last, where)
        if tag == "AllBlocksCleared":
            if values:
                counts.unknown_fields["AllBlocksCleared[1+]"] += 1
            return RawCleared()
        counts.unknown_tags[tag[:64]] += 1
        return None
    if isinstance(event, dict):
        map_tag = event.get("type")
        if not isinstance(map_tag, str):
            raise WireError(f"{where}: a map event needs a string 'type', got {brief(map_tag)}")
        tag = map_tag
        parsed: RawEvent
        if tag == "BlockStored":
            unknown = event.keys() - _STORED_MAP_KEYS
            for key in unknown:
                counts.unknown_fields[f"BlockStored.{key}"] += 1
            parsed = _stored(event, take_last, counts, where)
        elif tag == "BlockRemoved":
            unknown = event.keys() - _REMOVED_MAP_KEYS
            for key in unknown:
                counts.unknown_fields[f"BlockRemoved.{key}"] += 1
            parsed = _removed(event, take_last, where)
        elif tag == "AllBlocksCleared":
            for key in event:
                if key not in ("type", "ownership"):
                    counts.unknown_fields[f"AllBlocksCleared.{key}"] += 1
            parsed = RawCleared()
        else:
            counts.unknown_tags[tag[:64]] += 1
            return None
        elsewhere = _not_local(event, tag)
        if elsewhere is not None:  # read whole (a malformed one still raises), then left out
            counts.not_local[elsewhere] += 1
            return None
        return parsed
    raise WireError(f"{where}: an event must be an array or a map, got {type(event).__name__}")


def _not_local(event: dict[Any, Any], tag: str) -> str | None:
    """Why a map event is about blocks this worker's index must not hold, or None. vLLM marks an
    event's ``locality`` (absent or ``LOCAL``: on this worker; ``REMOTE`` or anything else: not,
    as Dynamo reads it) and its ``ownership`` (absent: the engine's own cache; set: another
    owner's, such as a KV-cache reuse service; an AllBlocksCleared with one clears that
    owner's cache, not the worker's)."""
    ownership = event.get("ownership")
    if ownership is not None:
        return f"{tag} ownership={str(ownership)[:32]}"
    locality = event.get("locality")
    if locality is not None and locality != "LOCAL" and tag != "AllBlocksCleared":
        return f"{tag} locality={str(locality)[:32]}"
    return None


def _hash_list(value: object, take_last: bool, where: str) -> list[int]:
    if not isinstance(value, list):
        raise WireError(f"{where}: must be an array of block hashes, got {type(value).__name__}")
    try:
        array("q", value)  # the common case: all ints of int64 range (msgpack ints), in C
    except (TypeError, OverflowError):
        pass
    else:
        if all(type(h) is int for h in value):  # bools are ints to array()
            return [h & U64_MASK for h in value]
    return [fold_hash(h, take_last=take_last, where=f"{where}[{k}]") for k, h in enumerate(value)]


def _opt_int(value: object, where: str, *, minimum: int | None = None) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise WireError(f"{where}: must be an int or null, got {type(value).__name__}")
    if minimum is not None and value < minimum:
        raise WireError(f"{where}: must be >= {minimum}, got {brief(value)}")
    return value


def _opt_str(value: object, where: str) -> str | None:
    if value is None or isinstance(value, str):
        return value
    raise WireError(f"{where}: must be a string or null, got {type(value).__name__}")


def _salt(value: object) -> str | None:
    if value is None:
        return None
    if isinstance(value, (bytes, bytearray)):
        return bytes(value).hex()
    return value if isinstance(value, str) else str(value)


def _stored(f: dict[str, Any], take_last: bool, counts: WireCounts, where: str) -> RawStored:
    if "block_hashes" not in f:
        raise WireError(f"{where}: BlockStored has no block_hashes")
    hashes = _hash_list(f["block_hashes"], take_last, f"{where}.block_hashes")
    parent_raw = f.get("parent_block_hash")
    parent = (
        None
        if parent_raw is None
        else fold_hash(parent_raw, take_last=take_last, where=f"{where}.parent_block_hash")
    )
    raw_tokens = f.get("token_ids")
    if raw_tokens is None:
        raw_tokens = []
    if not isinstance(raw_tokens, list):
        raise WireError(f"{where}.token_ids: must be an array, got {type(raw_tokens).__name__}")
    try:
        tokens, wide, pairs = array("i", raw_tokens), None, False  # every id an int32, in C
    except (TypeError, OverflowError):
        tokens, wide, pairs = _tokens(raw_tokens, f"{where}.token_ids")
    block_size = _opt_int(f.get("block_size"), f"{where}.block_size", minimum=0)
    if not block_size:  # absent, or 0 as vLLM's offloading placeholders send with no tokens
        if hashes and tokens:
            size = "no block_size" if block_size is None else "block_size 0"
            raise WireError(f"{where}: BlockStored has token_ids but {size}")
        block_size = 1
    lora_id = _opt_int(f.get("lora_id"), f"{where}.lora_id")
    if lora_id is not None and not -(1 << 63) <= lora_id < (1 << 64):
        raise WireError(f"{where}.lora_id: {lora_id} does not fit in 64 bits")
    medium = _opt_str(f.get("medium"), f"{where}.medium")
    lora_name: str | None = None
    cache_salt = _salt(f.get("cache_salt"))
    slot7 = f.get("lora_name")
    metadata = f.get("metadata")
    if isinstance(slot7, dict):  # old SGLang: a metadata map where vLLM has lora_name
        metadata, slot7 = slot7, None
    lora_name = _opt_str(slot7, f"{where}.lora_name")
    if metadata is not None:
        if not isinstance(metadata, dict):
            raise WireError(f"{where}.metadata: must be a map, got {type(metadata).__name__}")
        for key in metadata:
            if key not in _METADATA_FIELDS:
                counts.unknown_fields[f"BlockStored.metadata.{key}"] += 1
        if cache_salt is None:
            cache_salt = _salt(metadata.get("cache_salt"))
        if lora_name is None:
            lora_name = _opt_str(metadata.get("lora_name"), f"{where}.metadata.lora_name")
        if lora_id is None:
            lora_id = _opt_int(metadata.get("lora_id"), f"{where}.metadata.lora_id")
    extra = f.get("extra_keys")
    if extra is not None and not isinstance(extra, list):
        raise WireError(f"{where}.extra_keys: must be an array or null, got {type(extra).__name__}")
    return RawStored(
        block_hashes=hashes,
        parent=parent,
        token_ids=tokens,
        block_size=block_size,
        lora_id=lora_id,
        medium=medium,
        lora_name=lora_name,
        extra_keys=extra,
        group_idx=_opt_int(f.get("group_idx"), f"{where}.group_idx"),
        spec_kind=_opt_str(f.get("kv_cache_spec_kind"), f"{where}.kv_cache_spec_kind"),
        sliding_window=_opt_int(
            f.get("kv_cache_spec_sliding_window"), f"{where}.kv_cache_spec_sliding_window", minimum=0
        ),
        cache_salt=cache_salt,
        token_extra_ids=wide,
        token_pairs=pairs,
    )


def _tokens(raw: list[Any], where: str) -> tuple[array[int], array[int] | None, bool]:
    """Token ids that are not all int32: (ids, the wide tokens' values or None, pairs?). A token
    wider than 32 bits (SGLang's multimodal pad values reach 2**62) is ``WIDE_TOKEN_ID`` with its
    value in the extra ids; (token, next token) pairs (SGLang's bigram keys, with EAGLE) give
    their first token, the block's own (the second is the next one's)."""
    tokens = array("i")
    extras = array("Q")
    pairs = False
    for k, t in enumerate(raw):
        if isinstance(t, list) and len(t) == 2 and isinstance(t[1], int) and not isinstance(t[1], bool):
            t, pairs = t[0], True
        if isinstance(t, bool) or not isinstance(t, int):
            raise WireError(f"{where}[{k}]: {brief(t)} is not a token id (an int, or a pair of them)")
        if -(1 << 31) <= t < (1 << 31):
            tokens.append(t)
            extras.append(0)
        elif -(1 << 63) <= t < (1 << 64):
            tokens.append(WIDE_TOKEN_ID)
            extras.append(t & U64_MASK)
        else:
            raise WireError(f"{where}[{k}]: {t} does not fit in 64 bits")
    return tokens, (extras if any(extras) else None), pairs


def _removed(f: dict[str, Any], take_last: bool, where: str) -> RawRemoved:
    if "block_hashes" not in f:
        raise WireError(f"{where}: BlockRemoved has no block_hashes")
    return RawRemoved(
        block_hashes=_hash_list(f["block_hashes"], take_last, f"{where}.block_hashes"),
        medium=_opt_str(f.get("medium"), f"{where}.medium"),
        group_idx=_opt_int(f.get("group_idx"), f"{where}.group_idx"),
    )
