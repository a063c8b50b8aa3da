"""The attention backend interface: one call per attention layer per step.

A backend gets the step's projected queries/keys/values for the whole flattened batch, writes
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
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from impasto.attention.metadata import AttentionMetadata


class AttentionBackend(ABC):
    name: str = "abstract"

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,  # [T, Hq, D]
        k: torch.Tensor,  # [T, Hkv, D]
        v: torch.Tensor,  # [T, Hkv, D]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, Hkv, D]
        meta: AttentionMetadata,
        *,
        scale: float,
        sliding_window: int | None = None,
        logit_softcap: float | None = None,
    ) -> torch.Tensor:  # [T, Hq * D]
        """Write k/v into `kv_cache` at `meta.slot_mapping` (slots >= 0) and attend."""


_BACKENDS: dict[str, AttentionBackend] = {}


def get_attention_backend(name: str = "torch") -> AttentionBackend:
    """Return the process-wide instance of a backend (instances keep per-step plan caches)."""
    if name not in _BACKENDS:
        if name != "torch":
            raise ValueError(f"unknown attention backend {name!r}; supported: ['torch']")
        from impasto.attention.torch_backend import TorchAttentionBackend

        _BACKENDS[name] = TorchAttentionBackend()
    return _BACKENDS[name]
