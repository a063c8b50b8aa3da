"""Attention metadata for one step, built once by the runner and scoped with `forward_context`.

The batch is flattened: the T query tokens of B requests are concatenated in request order.
KV cache of one layer: a tensor `[2, num_blocks, block_size, num_kv_heads, head_size]`
(index 0 = keys, 1 = values). Token at position p of a request lives in slot
`block_table[b, p // block_size] * block_size + p % block_size`.

The forward context carries, for one forward, the metadata, the KV caches, the attention
backend and the plan that backend built from this metadata; attention layers read all four
from it, so a model never holds or names a backend.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from impasto.attention.backend import AttentionBackend, AttentionPlan


@dataclass(slots=True)
class AttentionMetadata:
    num_reqs: int
    num_tokens: int
    block_size: int
    # Host-side copies for shape decisions (never read tensors back in the hot path).
    query_lens: list[int]  # [B] new tokens per request this step
    seq_lens: list[int]  # [B] context length after this step = num_computed + query_len
    causal: list[bool]  # [B] False: bidirectional over the request's query tokens (diffusion)
    query_start_loc: torch.Tensor  # [B+1] int64, prefix sums of query_lens
    seq_lens_t: torch.Tensor  # [B] int64
    positions: torch.Tensor  # [T] int64, position of each query token
    slot_mapping: torch.Tensor  # [T] int64, cache slot to write; -1 = do not write
    block_table: torch.Tensor  # [B, max_blocks] int64
    # Block-causal requests (masked block diffusion): [B] block size per request, 1 = plain
    # (token-)causal. A query at position p of a request with block size K > 1 sees every key
    # below (p // K + 1) * K: its own block bidirectionally and all blocks before it. None:
    # every request is plain.
    causal_block: list[int] | None = None

    @property
    def max_query_len(self) -> int:
        return max(self.query_lens, default=0)

    @property
    def max_seq_len(self) -> int:
        return max(self.seq_lens, default=0)


@dataclass(slots=True)
class ForwardContext:
    metadata: AttentionMetadata
    kv_caches: list[torch.Tensor]  # one per attention layer, indexed by layer_idx
    backend: AttentionBackend[Any]
    plan: AttentionPlan  # backend.build_plan(metadata)


_CURRENT: ForwardContext | None = None


@contextmanager
def forward_context(
    metadata: AttentionMetadata,
    kv_caches: list[torch.Tensor],
    backend: AttentionBackend[Any],
    plan: AttentionPlan,
) -> Iterator[None]:
    """Make the step's metadata, caches, backend and plan (built by the caller from this
    metadata) visible to attention layers for one forward."""
    global _CURRENT
    previous = _CURRENT
    _CURRENT = ForwardContext(metadata, kv_caches, backend, plan)
    try:
        yield
    finally:
        _CURRENT = previous


def get_forward_context() -> ForwardContext:
    if _CURRENT is None:
        raise RuntimeError("attention called outside of forward_context()")
    return _CURRENT
