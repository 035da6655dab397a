"""``ZmqEventConverter``: one vLLM/SGLang ZMQ payload -> kvevents events, no sockets.

State carried between calls: the next event id per dp rank (from 0), the :class:`TierMap` (which
media hold each block) and the group -> window map learned from Stored events. A payload that
cannot be read raises :class:`BridgeDecodeError` and leaves the state as it was.
"""

from __future__ import annotations

import logging
import re
from array import array
from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from kvevents.schemas import (
    DEFAULT_PRIORITY,
    PRIMARY_LEVEL,
    KVCacheCreatedData,
    KVCacheEvent,
    KVCacheEventDiff,
    KVCacheRemovedData,
    KVCacheStoredBlockData,
    KVCacheStoredData,
    KVCacheUpdatedData,
)
from kvevents.schemas.limits import DEFAULT_LIMITS

from ..mm_keys import mm_key_from_text
from .fastwire import fast_convert, fast_parse
from .groups import SKIPPED_GROUP, skips_group
from .hashes import DEFAULT_MEDIUM_LEVELS, MAX_MEDIA, NEW_MEDIUM_LEVEL_MAX, WireError, lora_id_for_name
from .tiers import TierMap, saved_level
from .wire import BridgeDecodeError, ParsedBatch, RawRemoved, RawStored, WireCounts, parse_payload

if TYPE_CHECKING:
    from ..sink_encoded import EncodedEvents

log = logging.getLogger(__name__)

FastConvert = Callable[["ZmqEventConverter", bytes], "tuple[list[KVCacheEvent], float | None] | None"]
"""A one-pass conversion of the common shapes: events and ``ts``, or None (nothing changed)."""


def _load_compiled() -> FastConvert | None:
    try:
        from ._fastconvert import convert
    except ImportError:
        log.debug("kvevents.producer.bridge._fastconvert is not built; using the Python paths")
        return None
    return convert


FastEncode = Callable[["ZmqEventConverter", bytes, "EncodedEvents"], "tuple[int, float | None] | None"]
"""The same, the events appended to an ``EncodedEvents`` as Avro bytes: their number and ``ts``."""


def _load_encoder() -> FastEncode | None:
    try:
        from ._fastconvert import encode
    except ImportError:
        return None
    return encode


compiled_convert = _load_compiled()
compiled_encode = _load_encoder()
"""The compiled reader (:mod:`._fastconvert`), or None when not built; its pure-Python twin is
:func:`.fastwire.fast_convert` (same contract, fewer shapes taken)."""
_TWIN: FastConvert = fast_convert

__all__ = ["ENGINES", "ZmqEventConverter"]

ENGINES = ("vllm", "sglang")
_HEX64 = re.compile(r"^(0x)?[0-9a-fA-F]{64}$")
_MAX_MM_KEYS = DEFAULT_LIMITS.max_mm_keys_per_block
_MAX_EXTRA_KEYS = _MAX_MM_KEYS + 2  # and a LoRA name and a salt


class ZmqEventConverter:
    """Converts the payloads of one engine publisher (``engine``: ``"vllm"`` or ``"sglang"``).

    ``window_size``: the window of events without a sliding-window group (full attention);
    ``dp_rank``: the rank of events whose batch does not name one. ``counts`` says what was
    skipped (unknown tags/fields, duplicate stores, removes of blocks not held on that medium).
    ``fast_path``: read the common shapes by typed decoding first (:mod:`.fastwire`); the result
    is the same either way, ``fast_payloads`` counts the payloads it read. ``compiled``: try the
    compiled reader (:mod:`._fastconvert`, when built) before that; ``compiled_payloads`` counts
    the payloads it read.
    """

    def __init__(
        self,
        engine: str,
        *,
        window_size: int = 0,
        dp_rank: int = 0,
        fast_path: bool = True,
        compiled: bool = True,
    ) -> None:
        if engine not in ENGINES:
            raise ValueError(f"engine must be one of {ENGINES}, got {engine!r}")
        if isinstance(window_size, bool) or not isinstance(window_size, int) or window_size < 0:
            raise ValueError(f"window_size must be an int >= 0, got {window_size!r}")
        if isinstance(dp_rank, bool) or not isinstance(dp_rank, int) or dp_rank < 0:
            raise ValueError(f"dp_rank must be an int >= 0, got {dp_rank!r}")
        self.engine = engine
        self.window_size = window_size
        self.dp_rank = dp_rank
        self.take_last = engine == "vllm"
        self.next_event_id: dict[int, int] = {}
        self.tiers = TierMap()
        self.group_windows: dict[int, int] = {}
        self.media: dict[str, int] = dict(DEFAULT_MEDIUM_LEVELS)
        self.wire_counts = WireCounts()
        self.counts: Counter[str] = Counter()
        self.last_batch_ts: float | None = None
        """The ``ts`` of the last payload converted (the engine's send time, for latency)."""
        self.fast_path = fast_path
        self.fast_payloads = 0
        self.compiled = compiled and compiled_convert is not None
        self.compiled_payloads = 0

    # -- public ------------------------------------------------------------------------

    def convert(self, payload: bytes) -> list[KVCacheEvent]:
        """The kvevents events of one payload (possibly none)."""
        if self.fast_path:
            fused = compiled_convert(self, payload) if compiled_convert and self.compiled else None
            if fused is not None:
                self.compiled_payloads += 1
            else:
                fused = fast_convert(self, payload)
            if fused is not None:
                events, ts = fused
                self.fast_payloads += 1
                self.counts["payloads"] += 1
                self.last_batch_ts = ts
                self.counts["events_out"] += len(events)
                return events
        parsed = fast_parse(payload) if self.fast_path else None
        counts: WireCounts | None = None
        if parsed is None:
            counts = WireCounts()
            parsed = parse_payload(payload, take_last=self.take_last, counts=counts)
        else:
            self.fast_payloads += 1
        try:
            events = self._apply(parsed)
        except WireError as exc:
            raise BridgeDecodeError(str(exc)) from None
        if counts is not None:
            self.wire_counts.merge(counts)
        self.counts["payloads"] += 1
        self.last_batch_ts = parsed.ts
        self.counts["events_out"] += len(events)
        return events

    def convert_encoded(self, payload: bytes, out: EncodedEvents) -> bool:
        """:meth:`convert` by the compiled reader, the events appended to ``out`` as Avro bytes
        (no object per event, for the sink's pre-encoded path): True, or False (nothing changed)
        for a payload it does not take, or when it is not built: then call :meth:`convert`."""
        if not (self.fast_path and self.compiled and compiled_encode is not None):
            return False
        done = compiled_encode(self, payload, out)
        if done is None:
            return False
        n, ts = done
        self.compiled_payloads += 1
        self.fast_payloads += 1
        self.counts["payloads"] += 1
        self.last_batch_ts = ts
        self.counts["events_out"] += n
        return True

    def created(self, rank: int | None = None) -> KVCacheEvent:
        """A Created event for ``rank`` (the engine restarted: its cache is empty); clears the
        tier map of every window."""
        rank = self.dp_rank if rank is None else rank
        self.tiers.clear()
        return self._event(rank, KVCacheCreatedData([]), self.window_size)

    def stats(self) -> dict[str, Any]:
        return {**dict(self.counts), **self.wire_counts.as_dict(), "blocks_held": len(self.tiers)}

    def to_state(self) -> dict[str, Any]:
        """What the bridge's state file keeps of this converter."""
        return {
            "engine": self.engine,
            "window_size": self.window_size,
            "dp_rank": self.dp_rank,
            "next_event_id": {str(k): v for k, v in self.next_event_id.items()},
            "tiers": self.tiers.to_state(),
            "group_windows": {str(k): v for k, v in self.group_windows.items()},
            "media": self.media,
        }

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> ZmqEventConverter:
        conv = cls(state["engine"], window_size=int(state["window_size"]), dp_rank=int(state["dp_rank"]))
        conv.next_event_id = {int(k): int(v) for k, v in state["next_event_id"].items()}
        conv.tiers = TierMap.from_state(state["tiers"])
        conv.group_windows = {int(k): int(v) for k, v in state["group_windows"].items()}
        conv.media = {str(k): saved_level(v) for k, v in state["media"].items()}
        return conv

    # -- conversion --------------------------------------------------------------------

    def _apply(self, parsed: ParsedBatch) -> list[KVCacheEvent]:
        rank = self.dp_rank if parsed.dp_rank is None else parsed.dp_rank
        # Validate everything first, so that a bad event leaves the state untouched.
        raws = parsed.events
        blocks_of = [
            self._blocks(raw, k)
            if raw.__class__ is RawStored and not skips_group(raw.spec_kind, raw.sliding_window)
            else None
            for k, raw in enumerate(raws)
        ]
        out: list[tuple[Any, int]] = []  # (data, window); ids are given at the end, in order
        for raw, blocks in zip(raws, blocks_of, strict=True):
            if raw.__class__ is RawStored and blocks is None:
                assert isinstance(raw, RawStored)
                self._window(raw.group_idx, raw)  # learns the group is skipped
                self.counts["skipped_group_events"] += 1
            elif blocks is not None:
                assert isinstance(raw, RawStored)
                self._emit_stored(out, raw, blocks)
            elif isinstance(raw, RawRemoved):
                self._emit_removed(out, raw)
            else:
                self.counts["cleared"] += 1
                self.tiers.clear()
                out.append((KVCacheCreatedData([]), self.window_size))
        return self._numbered(out, rank)

    def _numbered(self, out: list[tuple[Any, int]], rank: int) -> list[KVCacheEvent]:
        """``out``'s (data, window) pairs as events of ``rank`` with the next ids, in order."""
        if not out:
            return []
        first = self.next_event_id.get(rank, 0)
        self.next_event_id[rank] = first + len(out)
        return [KVCacheEvent(first + i, data, window, rank) for i, (data, window) in enumerate(out)]

    def _level(self, medium: str | None, *, commit: bool = True) -> int:
        if medium is None:
            return 0
        level = self.media.get(medium)
        if level is None:
            level = self.media.get(medium.upper())
        if level is None and len(self.media) >= MAX_MEDIA:
            if commit:
                self.counts["new_medium.(past MAX_MEDIA)"] += 1
            return NEW_MEDIUM_LEVEL_MAX
        if level is None:
            level = min(max(self.media.values(), default=0) + 1, NEW_MEDIUM_LEVEL_MAX)
            if commit:
                self.media[medium] = level
                self.counts[f"new_medium.{medium[:32]}"] += 1
        return level

    def _window(self, group_idx: int | None, raw: RawStored | None = None) -> int:
        """The window of an event of ``group_idx`` (a Stored one, ``raw``, teaches its group's
        window), or ``SKIPPED_GROUP``: for a kind the index skips (``groups.skips_group``), and for
        a group other than 0 that no Stored event described yet (counted ``unknown_group``; its
        evictions could be a sliding window's of blocks the attention group holds)."""
        if raw is not None and skips_group(raw.spec_kind, raw.sliding_window):
            if group_idx is not None:
                self.group_windows[group_idx] = SKIPPED_GROUP
            return SKIPPED_GROUP
        if raw is not None and group_idx is not None:
            if raw.sliding_window:
                self.group_windows[group_idx] = raw.sliding_window
            elif raw.spec_kind is not None:
                self.group_windows.setdefault(group_idx, self.window_size)
        if group_idx is None:
            return self.window_size
        window = self.group_windows.get(group_idx)
        if window is None:
            self.counts["unknown_group"] += 1
            return self.window_size if group_idx == 0 else SKIPPED_GROUP
        return window

    def _sparse(self, raw: RawStored, n: int) -> bool:
        """Whether a grouped Stored event covers more whole pages of tokens than it has hashes:
        vLLM leaves a group's null or masked blocks (a sliding window's unreachable ones) out of
        ``block_hashes`` but not out of ``token_ids``, so which page a hash names is unknown.
        Its blocks are carried without tokens (matched by engine hash, not by content)."""
        size, tokens = raw.block_size, raw.token_ids
        if raw.group_idx is None or size < 1 or len(tokens) <= n * size or len(tokens) % size:
            return False
        self.counts["sparse_group_events"] += 1
        return True

    def _blocks(self, raw: RawStored, k: int) -> list[KVCacheStoredBlockData]:
        n = len(raw.block_hashes)
        tokens = raw.token_ids
        size = raw.block_size
        if n == 0:
            if tokens and raw.group_idx is None:
                raise WireError(f"events[{k}]: BlockStored has {len(tokens)} token_ids but no block_hashes")
            if tokens:  # a group that kept none of these pages (vLLM skips its null blocks)
                self.counts["stored_pages_without_hashes"] += 1
            return []
        wide = raw.token_extra_ids
        wides: list[array[int] | None] = [None] * n
        if not tokens or self._sparse(raw, n):
            pieces: list[array[int]] = [array("i") for _ in range(n)]
            self.counts["blocks_without_tokens"] += n
        else:
            full = (n - 1) * size
            if not full < len(tokens) <= n * size:
                raise WireError(
                    f"events[{k}]: {len(tokens)} token_ids do not fill {n} blocks of block_size {size} "
                    f"(expected {full + 1}..{n * size})"
                )
            pieces = [tokens] if n == 1 else [tokens[i * size : (i + 1) * size] for i in range(n)]
            if len(tokens) < n * size:
                self.counts["partial_blocks"] += 1
            if wide is not None:
                self.counts["wide_tokens"] += sum(1 for x in wide if x)
                wides = [w if any(w) else None for w in (wide[i * size : (i + 1) * size] for i in range(n))]
        if raw.token_pairs:
            self.counts["token_pair_blocks"] += n
        lora_id = raw.lora_id
        if lora_id is not None:
            lora_id &= (1 << 64) - 1
        elif raw.lora_name:
            lora_id = lora_id_for_name(raw.lora_name)
        extra = raw.extra_keys
        if extra is not None and len(extra) != n:
            self.counts["extra_keys_length_mismatch"] += 1
        salt0 = raw.cache_salt
        if extra is None:  # the common case: one positional construction per block
            return [
                KVCacheStoredBlockData(h, p, lora_id, PRIMARY_LEVEL, DEFAULT_PRIORITY, w, (), salt0)
                for h, p, w in zip(raw.block_hashes, pieces, wides, strict=True)
            ]
        blocks = []
        for i, (block_hash, piece) in enumerate(zip(raw.block_hashes, pieces, strict=True)):
            keys = extra[i] if extra is not None and i < len(extra) else None
            if keys is None:
                blocks.append(
                    KVCacheStoredBlockData(
                        block_hash,
                        piece,
                        lora_id,
                        PRIMARY_LEVEL,
                        DEFAULT_PRIORITY,
                        wides[i],
                        (),
                        raw.cache_salt,
                    )
                )
                continue
            first = i == 0 and raw.parent is None  # only a request's first block has a salt
            mm_keys, salt = self._extra(keys, raw.lora_name, first)
            salt = raw.cache_salt if raw.cache_salt is not None else salt
            blocks.append(
                KVCacheStoredBlockData(
                    block_hash, piece, lora_id, PRIMARY_LEVEL, DEFAULT_PRIORITY, wides[i], mm_keys, salt
                )
            )
        return blocks

    def _extra(
        self, keys: object, lora_name: str | None, first: bool
    ) -> tuple[tuple[tuple[bytes, int], ...], str | None]:
        """Multimodal keys and a cache salt out of one block's ``extra_keys``: vLLM's raw tuples
        (the LoRA name, then multimodal items as ``(identifier, offset)`` pairs or bare
        identifiers, then the salt on a request's ``first`` block) or its typed keys (maps
        tagged ``mm``, ``cache_salt``, ``lora``, ``prompt_embeds``, ``legacy``). A bare string
        other than the LoRA name is a multimodal identifier, except the last one of a
        request's first block, the salt (a non-hex identifier alone there is ambiguous and is
        read as the salt). A bare 32-byte value (vLLM's prompt-embeddings digest) is kept as a
        multimodal key, part of the block's identity; typed prompt-embedding keys and unknown
        keys are not carried by kvevents and are counted."""
        if keys is None:
            return (), None
        if not isinstance(keys, list):
            keys = [keys]
        if len(keys) > _MAX_EXTRA_KEYS:  # refused before anything is built from them
            raise WireError(
                f"a block's extra_keys has {len(keys)} entries: more than the {_MAX_MM_KEYS} multimodal "
                f"keys a consumer takes (BatchLimits.max_mm_keys_per_block), a LoRA name and a salt"
            )
        mm: list[tuple[bytes, int]] = []
        salts: list[str] = []
        last_text = max((k for k, key in enumerate(keys) if isinstance(key, str)), default=-1)
        for at, key in enumerate(keys):
            if isinstance(key, dict):
                key = _typed_extra_key(key)
            if isinstance(key, tuple):  # a typed salt or LoRA name: (kind, text)
                if key[0] == "cache_salt":
                    salts.append(key[1])
                continue
            offset = 0  # a bare identifier: vLLM sends no offset with it
            value: object = key
            pair = False
            if (
                isinstance(key, list)
                and len(key) == 2
                and isinstance(key[1], int)
                and not isinstance(key[1], bool)
            ):
                value, offset, pair = key[0], key[1], True
            if isinstance(value, str) and not pair and not _HEX64.match(value):
                if value == lora_name:
                    continue
                if first and at == last_text:
                    salts.append(value)
                    continue
            digest = _mm_digest(value)
            # As sent (an item that began in an earlier block has a negative offset): the
            # content hash absorbs it, so clamping would merge distinct blocks.
            if digest is not None and -(2**31) <= offset < 2**31:
                mm.append((digest, offset))
            else:
                self.counts["extra_keys_skipped"] += 1
        self.counts["extra_keys_skipped"] += max(0, len(salts) - 1)  # one salt per block is kept
        if len(mm) > _MAX_MM_KEYS:
            raise WireError(
                f"a block has {len(mm)} multimodal keys: more than the {_MAX_MM_KEYS} a consumer takes"
            )
        return tuple(mm), (salts[0] if salts else None)

    def _emit_stored(
        self, out: list[tuple[Any, int]], raw: RawStored, blocks: list[KVCacheStoredBlockData]
    ) -> None:
        window = self._window(raw.group_idx, raw)
        if window == SKIPPED_GROUP:  # a group learned as skipped, this event naming no kind
            self.counts["skipped_group_events"] += 1
            return
        self._emit_blocks(out, window, self._level(raw.medium), raw.parent, blocks)

    def _emit_blocks(
        self,
        out: list[tuple[Any, int]],
        window: int,
        level: int,
        parent: int | None,
        blocks: list[KVCacheStoredBlockData],
    ) -> None:
        """Stored/Updated events for ``blocks`` stored on ``level`` (the tier map decides)."""
        run: list[KVCacheStoredBlockData] = []
        run_parent = parent
        previous = parent
        held = self.tiers.held
        for block in blocks:
            key = window << 64 | block.block_hash  # tiers.block_key, inlined
            if key not in held:  # the common case, inlined: a block no medium holds yet
                held[key] = 1 << level
                if not run:
                    run_parent = previous
                run.append(block if level == 0 else _with_level(block, level))
                previous = block.block_hash
                continue
            change = self.tiers.store(window, block.block_hash, level)
            if change.kind == "stored":
                if not run:
                    run_parent = previous
                run.append(block if level == 0 else _with_level(block, level))
            else:
                if run:
                    out.append((KVCacheStoredData(run_parent, run), window))
                    run = []
                if change.kind == "updated":
                    assert change.old_level is not None and change.new_level is not None
                    diff = KVCacheEventDiff(change.old_level, change.new_level)
                    out.append((KVCacheUpdatedData(block.block_hash, cache_level=diff), window))
                else:
                    self.counts["blocks_already_held"] += 1
            previous = block.block_hash
        if run:
            out.append((KVCacheStoredData(run_parent, run), window))

    def _emit_removed(self, out: list[tuple[Any, int]], raw: RawRemoved) -> None:
        window = self._window(raw.group_idx)
        if window == SKIPPED_GROUP:
            self.counts["skipped_group_events"] += 1
            return
        self._emit_gone(out, window, self._level(raw.medium), raw.block_hashes)

    def _emit_gone(self, out: list[tuple[Any, int]], window: int, level: int, hashes: list[int]) -> None:
        """Removed/Updated events for ``hashes`` let go on ``level`` (the tier map decides)."""
        gone: list[int] = []
        held = self.tiers.held
        for block_hash in hashes:
            key = window << 64 | block_hash  # tiers.block_key, inlined
            levels = held.get(key)
            if levels == 1 << level:
                del held[key]  # the common case, inlined: the only medium lets it go
                gone.append(block_hash)
                continue
            if levels is None:
                # Not seen stored (joined mid-stream, or a capture): pass it on, the index decides.
                self.counts["removed_unknown"] += 1
                gone.append(block_hash)
                continue
            change = self.tiers.remove(window, block_hash, level)
            if change.kind == "removed":
                gone.append(block_hash)
            elif change.kind == "updated":
                if gone:
                    out.append((KVCacheRemovedData(gone), window))
                    gone = []
                assert change.old_level is not None and change.new_level is not None
                diff = KVCacheEventDiff(change.old_level, change.new_level)
                out.append((KVCacheUpdatedData(block_hash, cache_level=diff), window))
            else:
                self.counts["removed_not_on_medium"] += 1
        if gone:
            out.append((KVCacheRemovedData(gone), window))

    def _event(self, rank: int, data: Any, window: int) -> KVCacheEvent:
        event_id = self.next_event_id.get(rank, 0)
        self.next_event_id[rank] = event_id + 1
        return KVCacheEvent(event_id, data, window, rank)


def _with_level(block: KVCacheStoredBlockData, level: int) -> KVCacheStoredBlockData:
    return KVCacheStoredBlockData(
        block.block_hash,
        block.tokens,
        block.lora_id,
        level,
        block.priority,
        block.token_extra_ids,
        block.mm_keys,
        block.cache_salt,
    )


def _mm_digest(value: object) -> bytes | None:
    """A multimodal item's key: a 32-byte digest as it is, text (a hex digest, a user-given
    UUID, an identifier with a LoRA prefix) as
    :func:`~kvevents.producer.mm_keys.mm_key_from_text` keys it; None for anything else."""
    if isinstance(value, (bytes, bytearray)) and len(value) == 32:
        return bytes(value)
    if isinstance(value, str):
        try:
            return mm_key_from_text(value)
        except UnicodeEncodeError:
            return None
    return None


def _typed_extra_key(key: dict[Any, Any]) -> object:
    """vLLM's typed extra key (a map tagged by ``type``) as the raw form ``_extra`` reads: an
    ``mm`` key as its ``[hash, block_offset]`` pair, a ``legacy`` key as its value, a salt or a
    LoRA name as ``(kind, text)``; anything else (prompt embeddings, unknown) as None."""
    kind = key.get("type")
    if kind == "mm":
        offset = key.get("block_offset", 0)
        return [key.get("hash"), offset] if isinstance(key.get("hash"), (str, bytes)) else None
    if kind == "legacy":
        value = key.get("value")
        return None if isinstance(value, dict) else value
    if kind == "cache_salt" and isinstance(key.get("salt"), str):
        return ("cache_salt", key["salt"])
    if kind == "lora" and isinstance(key.get("name"), str):
        return ("lora", key["name"])
    return None
