"""Which of vLLM's KV-cache groups the index takes (``group_idx``, ``kv_cache_spec_kind``)."""

from __future__ import annotations

__all__ = ["KEPT_KINDS", "SKIPPED_GROUP", "SKIPPED_KINDS", "WINDOW_KINDS", "skips_group"]

SKIPPED_GROUP = -1
"""The window a converter keeps for a group whose events the index does not take."""

SKIPPED_KINDS = frozenset({"mamba", "chunked_local_attention", "encoder_only_attention", "cross_attention"})
"""Kinds whose groups only mirror the attention groups' blocks. They publish the same hashes
for a subset of the blocks (a hybrid model's Mamba states, Llama 4's local-attention chunks),
so a removal of theirs is no removal of the block, and their stores leave out the blocks they
keep no state for (fewer hashes than pages of tokens). Their events are skipped and counted
(``skipped_group_events``): vLLM's event docs leave it to consumers to filter groups by kind."""

WINDOW_KINDS = frozenset({"sliding_window", "sliding_window_mla"})
"""Kinds whose groups keep a sliding window of the blocks: indexed in that window, when named."""

KEPT_KINDS = frozenset({"full_attention", "mla_attention", "sink_full_attention"}) | WINDOW_KINDS
"""Kinds the index takes. Any other kind named (vLLM's ``unknown``, for a group of mixed layer
types; one newer than this bridge) is skipped like :data:`SKIPPED_KINDS`: what its blocks mean
is not known, and taking its evictions as the block's would remove blocks the attention group
still holds."""


def skips_group(kind: str | None, sliding_window: int | None) -> bool:
    """Whether a Stored event of vLLM's group ``kind`` is skipped, and its group with it: a kind
    not in :data:`KEPT_KINDS`, or a sliding-window kind with no window (vLLM names none for a
    group whose layers have different windows). No kind named (older payloads): taken."""
    if kind is None:
        return False
    if kind in WINDOW_KINDS:
        return not sliding_window
    return kind not in KEPT_KINDS
