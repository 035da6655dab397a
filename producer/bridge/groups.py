"""Which of vLLM's KV-cache groups the index takes (``group_idx``, ``kv_cache_spec_kind``)."""

from __future__ import annotations

__all__ = ["SKIPPED_GROUP", "SKIPPED_KINDS"]

SKIPPED_GROUP = -1
"""The window a converter keeps for a group whose events the index does not take."""

SKIPPED_KINDS = frozenset({"mamba", "chunked_local_attention", "encoder_only_attention", "cross_attention"})
"""Kinds whose groups only mirror the attention groups' blocks. They publish the same hashes
for a subset of the blocks (a hybrid model's Mamba states, Llama 4's local-attention chunks),
so a removal of theirs is no removal of the block, and their stores leave out the blocks they
keep no state for (fewer hashes than pages of tokens). Their events are skipped and counted
(``skipped_group_events``): vLLM's event docs leave it to consumers to filter groups by kind."""
