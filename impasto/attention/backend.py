"""The attention backend interface: a plan per step, then one call per attention layer.

The runner asks the step's backend for a plan once per forward (`build_plan`), and scopes both
with `forward_context`; every attention layer then calls `forward` with that plan, so whatever
a backend derives from the metadata (request grouping, masks, index tensors) is computed once
per step and shared by all layers. Models never name a backend (see `registry.py`).

`forward` gets the step's projected queries/keys/values for the whole flattened batch, writes
the new keys/values into the layer's paged KV cache, and returns the attention output.
Semantics (per request b, see `metadata.py`):

- the context before this step is `ctx = seq_lens[b] - query_lens[b]` tokens, read from the
  paged cache through `block_table[b]`; query token i sits at absolute position `ctx + i`;
- the step's own keys/values are the `k`/`v` arguments (a request whose `slot_mapping` is -1,
  e.g. a diffusion denoise step, still attends to its own queries' keys, and the cache is not
  written for it);
- `causal[b]`: query i sees cached tokens and new tokens j <= i; otherwise all of its new tokens;
- `sliding_window` w: a query at position p sees keys at positions kp with `p - kp < w`
  (non-causal queries: `|p - kp| < w`);
- `logit_softcap` c: scores become `c * tanh(scores / c)` before masking and softmax.

Invariant: a plan is only valid for the metadata it was built from, and is never cached
across forwards (a step's metadata may be edited before its plan is built, never after).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Generic, TypeVar

import torch

from impasto.attention.metadata import AttentionMetadata


class AttentionPlan:
    """What a backend derives once from one step's metadata; the base every plan extends."""

    def fused_short_queries(
        self, kv_cache: torch.Tensor, dtype: torch.dtype
    ) -> torch.Tensor | None:
        """Whether the fused CPU paged attention (the kernels' `paged_attention`: cache write +
        attention of every request in one call) takes this step's attention for a cache like
        `kv_cache` and queries of `dtype`: if so, the [B] bool causal flags it takes, else None.

        The whole-stack decode path (`kernels/decoder_stack.py`, which chains that kernel) asks
        the same question, so both take a step or neither does. Default: None (a backend
        without that kernel)."""
        return None


PlanT = TypeVar("PlanT", bound=AttentionPlan)


class AttentionBackend(ABC, Generic[PlanT]):
    name: str = "abstract"

    @abstractmethod
    def build_plan(self, metadata: AttentionMetadata) -> PlanT:
        """The step's plan: called once per forward, after the metadata's last edit."""

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,  # [T, Hq, D]
        k: torch.Tensor,  # [T, Hkv, D]
        v: torch.Tensor,  # [T, Hkv, D]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, Hkv, D]
        metadata: AttentionMetadata,
        plan: PlanT,  # `build_plan(metadata)`
        *,
        scale: float,
        sliding_window: int | None = None,
        logit_softcap: float | None = None,
        reproducible: bool = False,
    ) -> torch.Tensor:  # [T, Hq * D]
        """Write k/v into `kv_cache` at `metadata.slot_mapping` (slots >= 0) and attend.

        `reproducible`: where the backend can, compute each query row independently of the
        step's other rows, of how the step is chunked and of whether its keys came from the
        prefix cache (bit for bit); a backend that cannot may ignore it."""
