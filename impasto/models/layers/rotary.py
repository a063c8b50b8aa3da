"""Rotary position embedding (rotate-half / NeoX layout, as in HF Llama/Qwen).

Supported `rope_type`s: default, linear, llama3 (plus `partial_rotary_factor`). The cos/sin
table is computed once per forward from the positions (`cos_sin`) and shared by all layers;
`inv_freq` is a plain float32 attribute, so `model.to(bfloat16)` never degrades it.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from impasto.models.layers.device_hooks import FusedOps


def rope_parameters(config: Any) -> dict[str, Any]:
    """HF rope settings as one dict (transformers 5 `rope_parameters`, or 4.x fields)."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    legacy = getattr(config, "rope_scaling", None) or {}
    params = {**legacy, **params}
    params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    params.setdefault("rope_type", params.pop("type", "default"))
    if "partial_rotary_factor" not in params and hasattr(config, "partial_rotary_factor"):
        params["partial_rotary_factor"] = config.partial_rotary_factor
    return params


def inv_frequencies(head_dim: int, params: dict[str, Any]) -> torch.Tensor:  # [rot_dim // 2]
    rot_dim = int(head_dim * params.get("partial_rotary_factor", 1.0))
    base = float(params["rope_theta"])
    exponent = torch.arange(0, rot_dim, 2, dtype=torch.int64).float() / rot_dim
    inv_freq = 1.0 / (base**exponent)
    kind = params.get("rope_type", "default")
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / params["factor"]
    if kind == "llama3":
        factor, low, high = params["factor"], params["low_freq_factor"], params["high_freq_factor"]
        old_ctx = params["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_ctx / low, inv_freq / factor, inv_freq)
        smooth = (old_ctx / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old_ctx / high) & ~(wavelen > old_ctx / low)
        return torch.where(medium, smoothed, scaled)
    raise NotImplementedError(f"rope_type {kind!r} is not supported (default, linear, llama3)")


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, params: dict[str, Any]) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.inv_freq = inv_frequencies(head_dim, params)  # float32, not a buffer (see above)
        self.rot_dim = 2 * self.inv_freq.numel()
        self.fused_ops: FusedOps | None = None  # `use_kernels`: in-place rotation in one kernel

    def use_kernels(self, ops: FusedOps) -> bool:
        self.fused_ops = ops
        return True

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """[T] -> [2, T, 1, rot_dim]: (cos | cos, -sin | sin), float32 math then cast like HF."""
        inv = self.inv_freq.to(positions.device)
        freqs = positions.float()[:, None] * inv  # [T, rot/2]
        cos, sin = freqs.cos(), freqs.sin()
        table = torch.stack([torch.cat([cos, cos], -1), torch.cat([-sin, sin], -1)])
        return table.to(dtype)[:, :, None, :]

    def forward(
        self, x: torch.Tensor, cos_sin: torch.Tensor, *, inplace: bool = False
    ) -> torch.Tensor:
        """Rotate x [T, H, head_dim] (head_dim contiguous); returns the rotated tensor.

        x * cos + rotate_half(x) * sin, with rotate_half's sign folded into the sin table and
        the half swap done by `roll` (bit-identical to HF's formula). `inplace=True` allows
        (does not require) writing into x, which the fused kernel does.
        """
        if inplace and self.fused_ops is not None:
            self.fused_ops.rotary_(x, cos_sin)
            return x
        if self.rot_dim < self.head_dim:  # partial rotary: the tail passes through
            head = _rotate(x[..., : self.rot_dim], cos_sin)
            return torch.cat([head, x[..., self.rot_dim :]], dim=-1)
        return _rotate(x, cos_sin)


def _rotate(x: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
    return x * cos_sin[0] + x.roll(x.shape[-1] // 2, -1) * cos_sin[1]
