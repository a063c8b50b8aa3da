"""Paged attention layer: routes one layer's q/k/v to the step's attention backend.

The backend and its plan for the step come from the forward context (see
`impasto.attention.metadata`), never from the model: which backend runs is the runner's choice.
"""

from __future__ import annotations

import torch
from torch import nn

from impasto.attention.metadata import get_forward_context


class Attention(nn.Module):
    """Holds no weights. Reads `kv_caches[layer_idx]`, the metadata, the backend and its plan
    from the forward context."""

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        layer_idx: int,
        *,
        scale: float | None = None,
        sliding_window: int | None = None,
        logit_softcap: float | None = None,
    ) -> None:
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"{num_heads} query heads are not a multiple of {num_kv_heads}")
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.layer_idx = layer_idx
        self.scale = head_dim**-0.5 if scale is None else scale
        self.sliding_window = sliding_window
        self.logit_softcap = logit_softcap
        # Set by device preparation for models whose results must not depend on the batch
        # bit for bit (packed GGUF weights: see `make_reproducible`).
        self.reproducible = False

    def make_reproducible(self) -> bool:
        """Ask the backend for batch-, chunk- and cache-invariant attention. Packed GGUF
        layers quantize their inputs to 8 bits, so a last-bit difference upstream can move a
        value across a rounding boundary and change the output visibly."""
        self.reproducible = True
        return True

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [T, Hq(*D)], k/v [T, Hkv(*D)] (views allowed) -> [T, Hq*D]."""
        ctx = get_forward_context()
        t, d = q.shape[0], self.head_dim
        return ctx.backend.forward(
            q.view(t, self.num_heads, d),
            k.view(t, self.num_kv_heads, d),
            v.view(t, self.num_kv_heads, d),
            ctx.kv_caches[self.layer_idx],
            ctx.metadata,
            ctx.plan,
            scale=self.scale,
            sliding_window=self.sliding_window,
            logit_softcap=self.logit_softcap,
            reproducible=self.reproducible,
        )

    def extra_repr(self) -> str:
        return (
            f"heads={self.num_heads}, kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, "
            f"layer={self.layer_idx}, window={self.sliding_window}"
        )
