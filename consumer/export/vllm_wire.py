"""vLLM's KV-event wire format (``vllm/distributed/kv_events.py``), for publishing to routers.

Structs as vLLM declares them (msgspec, ``omit_defaults``, events tagged by class name):

- ``BlockStored{block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium,
  lora_name, extra_keys=None, group_idx=None, kv_cache_spec_kind=None,
  kv_cache_spec_sliding_window=None}``; ``BlockRemoved{block_hashes, medium, group_idx=None}``;
  ``AllBlocksCleared{}``; batch ``KVEventBatch(ts, events, data_parallel_rank=None)``.
- The batch is always the array ``[ts, events, data_parallel_rank]`` (vLLM's ``EventBatch`` is
  ``array_like``; llm-d's and Dynamo's decoders read it only so). Events, by default
  (``positional``), as older vLLM writes them: arrays with the tag first (``["BlockStored",
  hashes, parent, ...]``, every field written: msgspec omits no default of an array), the
  one encoding every llm-d-kv-cache release reads (up to v0.8.1 and its main branch of
  2026-06 it refuses anything else, the whole batch) and Dynamo reads too. Current vLLM
  (since #42892) writes maps with ``"type": "<class name>"`` (``positional=False``), which
  Dynamo and llm-d with its map support (open PR #661 as of 2026-06) read; map events omit
  their defaults.
- Block and parent hashes always as 8-byte uint64s (``packed.pack_hashes``): llm-d takes no
  smaller int for a hash.

Live messages: 3 frames ``[topic, seq (u64 big-endian), payload]``; replay replies
``[topic, seq, payload]`` (or ``[seq, payload]``), then ``seq = 2**64 - 1`` with an empty payload.
"""

from __future__ import annotations

from typing import Any

import msgspec

from .packed import pack_hash, pack_hashes

__all__ = [
    "END_SEQ",
    "MEDIUM_BY_LEVEL",
    "VllmWire",
    "medium_for_level",
]

END_SEQ = 0xFFFF_FFFF_FFFF_FFFF
"""The seq of a replay's end marker (vLLM sends ``(-1).to_bytes(8, "big", signed=True)``)."""

MEDIUM_BY_LEVEL = {0: "GPU", 1: "CPU", 2: "DISK", 3: "EXTERNAL"}
"""kvevents cache level -> vLLM ``medium`` (the levels the bridges read these media as; levels
above 3 are ``EXTERNAL`` too: a medium a router does not know, such as ``LEVEL4``, counted as
GPU in Dynamo and at full weight in llm-d)."""


def medium_for_level(level: int) -> str:
    """The ``medium`` string for a kvevents cache level."""
    return MEDIUM_BY_LEVEL.get(level) or "EXTERNAL"


class VllmWire:
    """vLLM's structs in one encoding of events (``positional`` True, the default: arrays;
    False: tagged maps; the batch is an array either way) and an encoder for batches.
    ``stored``/``removed``/``cleared`` build events; ``encode`` a batch."""

    def __init__(self, positional: bool = True) -> None:
        self.positional = positional
        opts: dict[str, Any] = {"omit_defaults": True, "gc": False, "array_like": positional}
        none: Any = None
        self.BlockStored = msgspec.defstruct(
            "BlockStored",
            [
                ("block_hashes", list[int]),
                ("parent_block_hash", int | None),
                ("token_ids", list[int]),
                ("block_size", int),
                ("lora_id", int | None),
                ("medium", str | None),
                ("lora_name", str | None),
                ("extra_keys", list[Any] | None, none),
                ("group_idx", int | None, none),
                ("kv_cache_spec_kind", str | None, none),
                ("kv_cache_spec_sliding_window", int | None, none),
            ],
            tag=True,
            **opts,
        )
        self.BlockRemoved = msgspec.defstruct(
            "BlockRemoved",
            [("block_hashes", list[int]), ("medium", str | None), ("group_idx", int | None, none)],
            tag=True,
            **opts,
        )
        self.AllBlocksCleared = msgspec.defstruct("AllBlocksCleared", [], tag=True, **opts)
        event_type: Any = self.BlockStored | self.BlockRemoved | self.AllBlocksCleared
        self.EventBatch = msgspec.defstruct(
            "KVEventBatch",
            [("ts", float), ("events", list[event_type]), ("data_parallel_rank", int | None, none)],
            **{**opts, "array_like": True},
        )
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(self.EventBatch)
        self.cleared = self.AllBlocksCleared()

    def stored(
        self,
        block_hashes: list[int],
        parent: int | None,
        token_ids: list[int],
        block_size: int,
        lora_id: int | None,
        medium: str,
        lora_name: str | None = None,
    ) -> Any:
        return self.BlockStored(
            pack_hashes(block_hashes), pack_hash(parent), token_ids, block_size, lora_id, medium, lora_name
        )

    def removed(self, block_hashes: list[int] | msgspec.Raw, medium: str) -> Any:
        hashes = block_hashes if isinstance(block_hashes, msgspec.Raw) else pack_hashes(block_hashes)
        return self.BlockRemoved(hashes, medium)

    def encode(self, ts: float, events: list[Any], dp_rank: int | None) -> bytes:
        """msgpack of one batch."""
        return self._encoder.encode(self.EventBatch(ts, events, dp_rank))

    def decode(self, payload: bytes) -> Any:
        """The inverse of :meth:`encode` (for tests and tools)."""
        return self._decoder.decode(payload)
