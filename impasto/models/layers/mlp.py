"""Gated feed-forward: down(act(gate(x)) * up(x)), with gate/up fused in one matmul.

`act` is SiLU (SwiGLU: Llama, Qwen) or tanh-approximated GELU (GeGLU: Gemma), by the names
HF configs use for them. Only SiLU has a fused kernel; a GELU MLP declines `use_kernels` and
stays eager, computing exactly what HF's `GELUTanh` does (`F.gelu(approximate="tanh")`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from impasto.models.layers.device_hooks import FusedOps
from impasto.models.layers.linear import MergedColumnParallelLinear, RowParallelLinear
from impasto.models.layers.parallel import shard_size

# The fused SiLU * up saves two dispatches, which decides decode-sized steps (1.9x faster at one
# row); for prefill chunks PyTorch's vectorized kernels are faster (0.8x at 128 rows, 0.6x at
# 512; benchmarks/cpu_kernels.py), so larger inputs stay eager.
FUSED_SILU_MAX_ROWS = 64


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


# HF activation name -> (function, whether the fused SiLU kernel computes it)
_ACTIVATIONS: dict[str, tuple[Callable[[torch.Tensor], torch.Tensor], bool]] = {
    "silu": (F.silu, True),
    "swish": (F.silu, True),
    "gelu_pytorch_tanh": (_gelu_tanh, False),
    "gelu_tanh": (_gelu_tanh, False),
}


class GatedMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, bias: bool = False, act: str = "silu"):
        super().__init__()
        if act not in _ACTIVATIONS:
            supported = ", ".join(sorted(_ACTIVATIONS))
            raise NotImplementedError(f"MLP activation {act!r} is not supported ({supported})")
        self.act, self.silu = _ACTIVATIONS[act]
        self.gate_up_proj = MergedColumnParallelLinear(hidden, [intermediate] * 2, bias=bias)
        self.down_proj = RowParallelLinear(intermediate, hidden, bias=bias)
        self.local = shard_size(intermediate)  # this rank's (zero-padded) share
        self.fused_ops: FusedOps | None = None  # `use_kernels`: SiLU * up in one kernel
        # Steps above this many rows compute SiLU eagerly (faster there); `make_reproducible`
        # lifts the limit, so that no row's bits depend on the size of its step.
        self.fused_max_rows: int | None = FUSED_SILU_MAX_ROWS

    def make_reproducible(self) -> bool:
        self.fused_max_rows = None
        return True

    def use_kernels(self, ops: FusedOps) -> bool:
        if not self.silu:
            return False  # the only fused activation is SiLU
        self.fused_ops = ops
        return True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)  # [T, 2 * I_local]
        limit = self.fused_max_rows
        if self.fused_ops is not None and (limit is None or gate_up.shape[0] <= limit):
            return self.down_proj(self.fused_ops.silu_and_mul(gate_up))
        gate, up = gate_up[:, : self.local], gate_up[:, self.local :]
        return self.down_proj(self.act(gate) * up)
