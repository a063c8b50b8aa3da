"""Gemma-4-style mixture of experts: a normalised router, top-k experts with gated GELU MLPs.

Weights follow the HF layout: `router.{proj.weight, scale, per_expert_scale}` and stacked
`experts.gate_up_proj [E, 2I, H]`, `experts.down_proj [E, H, I]`. Token slots are
sorted by expert id, so each expert multiplies exactly its tokens: one grouped GEMM for all
experts when torch has it, else one matmul per expert.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

_GROUPED = hasattr(torch, "_grouped_mm")


def _param(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


class GemmaRouter(nn.Module):
    def __init__(self, hidden: int, num_experts: int, top_k: int, eps: float) -> None:
        super().__init__()
        self.top_k, self.eps = top_k, eps
        self.root = hidden**-0.5
        self.proj = nn.Linear(hidden, num_experts, bias=False)
        self.proj.weight.requires_grad_(False)
        self.scale = _param(hidden)
        self.per_expert_scale = _param(num_experts)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> (weights [T, k] float32, expert ids [T, k])."""
        xf = x.float()
        xf = xf * torch.pow(xf.pow(2).mean(-1, keepdim=True) + self.eps, -0.5)  # unscaled RMSNorm
        h = xf.to(x.dtype) * self.scale * self.root
        probs = torch.softmax(self.proj(h), dim=-1, dtype=torch.float32)  # [T, E]
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        weights = weights / weights.sum(-1, keepdim=True)
        return weights * self.per_expert_scale[ids].float(), ids


class GemmaExperts(nn.Module):
    def __init__(self, hidden: int, intermediate: int, num_experts: int) -> None:
        super().__init__()
        self.num_experts, self.intermediate = num_experts, intermediate
        self.gate_up_proj = _param(num_experts, 2 * intermediate, hidden)
        self.down_proj = _param(num_experts, hidden, intermediate)

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """x [T, H], weights/ids [T, k] -> [T, H] = sum_j weights[t, j] * expert_ids[t, j](x[t])."""
        t, k = ids.shape
        flat = ids.reshape(-1)  # [T*k], slot s = (token s // k, choice s % k)
        order = torch.argsort(flat, stable=True)
        xs = x.index_select(0, order // k)  # [T*k, H] tokens grouped by expert
        counts = torch.bincount(flat, minlength=self.num_experts)
        if _GROUPED:  # one grouped GEMM per projection for all experts
            offs = torch.cumsum(counts, 0).to(torch.int32)
            gate, up = torch._grouped_mm(xs, self.gate_up_proj.transpose(1, 2), offs=offs).chunk(
                2, -1
            )
            h = F.gelu(gate, approximate="tanh") * up  # [T*k, I]
            ys = torch._grouped_mm(h, self.down_proj.transpose(1, 2), offs=offs)  # [T*k, H]
        else:
            ys = torch.empty_like(xs)
            start = 0
            for e, n in enumerate(counts.tolist()):
                if n == 0:
                    continue
                rows = slice(start, start + n)
                gate, up = F.linear(xs[rows], self.gate_up_proj[e]).chunk(2, dim=-1)
                ys[rows] = F.linear(F.gelu(gate, approximate="tanh") * up, self.down_proj[e])
                start += n
        w = weights.reshape(-1)[order].to(ys.dtype)  # [T*k] routing weight of each slot
        out = torch.empty_like(ys).index_copy_(0, order, ys * w[:, None])  # back to slot order
        return out.view(t, k, -1).sum(1)  # [T, k, H] -> [T, H]
