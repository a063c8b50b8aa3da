"""RMSNorm, optionally fused with the residual add that precedes it."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from impasto.models.layers.device_hooks import FusedOps


class RMSNorm(nn.Module):
    """y = x / rms(x) * w (computed in float32, like HF).

    `gemma=True`: y = x / rms(x) * (1 + w), with the weight stored zero-centred (Gemma).
    `forward(x, residual)` first does `x = x + residual` and returns `(norm(x), x)`, so that
    decoder layers carry the residual stream without an extra add kernel.

    `use_kernels(ops)` (device preparation, bf16 CPU models) does either in one kernel;
    subclasses that change the formula override it to decline.
    """

    def __init__(self, dim: int, eps: float = 1e-6, *, gemma: bool = False) -> None:
        super().__init__()
        self.eps = eps
        self.gemma = gemma
        self.weight = nn.Parameter(torch.empty(dim), requires_grad=False)
        self.fused_ops: FusedOps | None = None

    def use_kernels(self, ops: FusedOps) -> bool:
        self.fused_ops = ops
        return True

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        if not self.gemma:  # bit-identical to HF in float32; bf16 skips one rounding step
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * (1.0 + self.weight.float())).to(x.dtype)  # Gemma: float32 product

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        ops = self.fused_ops  # the kernels take any leading shape ([T, N], [T, H, D] views)
        if ops is not None:
            if residual is None:
                return ops.rms_norm(x, self.weight, self.eps, self.gemma)
            return ops.add_rms_norm(x, residual, self.weight, self.eps, self.gemma)
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x
