"""SwiGLU feed-forward: down(silu(gate(x)) * up(x)), with gate/up fused in one matmul."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from impasto.models.layers.linear import MergedColumnParallelLinear, RowParallelLinear
from impasto.models.layers.parallel import divide, tp_size


class SwiGLUMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, bias: bool = False, act: str = "silu"):
        super().__init__()
        if act not in ("silu", "swish"):
            raise NotImplementedError(f"MLP activation {act!r} is not supported (silu)")
        self.gate_up_proj = MergedColumnParallelLinear(hidden, [intermediate] * 2, bias=bias)
        self.down_proj = RowParallelLinear(intermediate, hidden, bias=bias)
        self.local = divide(intermediate, tp_size())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)  # [T, 2 * I_local]
        gate, up = gate_up[:, : self.local], gate_up[:, self.local :]
        return self.down_proj(F.silu(gate) * up)
