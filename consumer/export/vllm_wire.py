"""vLLM's KV-event wire format (``vllm/distributed/kv_events.py``), for publishing to routers.

Structs as vLLM declares them (msgspec, ``omit_defaults``, events tagged by class name):

- ``BlockStored{block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium,
  lora_name, extra_keys=None, group_idx=None, kv_cache_spec_kind=None,
  kv_cache_spec_sliding_window=None}``; ``BlockRemoved{block_hashes, medium, group_idx=None}``;
  ``AllBlocksCleared{}``; batch ``KVEventBatch(ts, events, data_parallel_rank=None)``.
- The batch is always the array ``[ts, events, data_parallel_rank]`` (vLLM's ``EventBatch`` is
  ``array_like``; llm-d's and Dynamo's decoders read it only so). Events: current vLLM (since
  #42892) writes maps with ``"type": "<class name>"``, which llm-d-kv-cache >= v0.9 and Dynamo
  read; older vLLM (``positional``) arrays with the tag first (``["BlockStored", hashes,
  parent, ...]``, every field written: msgspec omits no default of an array), which older
  llm-d decoders need. Map events omit their defaults.

Live messages: 3 frames ``[topic, seq (u64 big-endian), payload]``; replay replies
``[topic, seq, payload]`` (or ``[seq, payload]``), then ``seq = 2**64 - 1`` with an empty payload.
"""

from __future__ import annotations

from typing import Any

import msgspec

__all__ = [
    "END_SEQ",
    "MEDIUM_BY_LEVEL",
    "VllmWire",
    "medium_for_level",
]

END_SEQ = 0xFFFF_FFFF_FFFF_FFFF
"""The seq of a replay's end marker (vLLM sends ``(-1).to_bytes(8, "big", signed=True)``)."""

MEDIUM_BY_LEVEL = {0: "GPU", 1: "CPU", 2: "DISK"}
"""kvevents cache level -> vLLM ``medium`` (levels above get ``LEVEL<n>``)."""


def medium_for_level(level: int) -> str:
    """The ``medium`` string for a kvevents cache level."""
    return MEDIUM_BY_LEVEL.get(level) or f"LEVEL{level}"


class VllmWire:
    """vLLM's structs in one encoding of events (``positional`` False: tagged maps; True:
    arrays; the batch is an array either way) and an encoder for batches. ``stored``/``removed``/``cleared`` build events; ``encode`` a batch."""

    def __init__(self, positional: bool = False) -> None:
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
        return self.BlockStored(block_hashes, parent, token_ids, block_size, lora_id, medium, lora_name)

    def removed(self, block_hashes: list[int], medium: str) -> Any:
        return self.BlockRemoved(block_hashes, medium)

    def encode(self, ts: float, events: list[Any], dp_rank: int | None) -> bytes:
        """msgpack of one batch."""
        return self._encoder.encode(self.EventBatch(ts, events, dp_rank))

    def decode(self, payload: bytes) -> Any:
        """The inverse of :meth:`encode` (for tests and tools)."""
        return self._decoder.decode(payload)
