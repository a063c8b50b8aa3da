"""All decoder layers of a Llama-family model in one native call, for short-query steps.

A batch-1 decode step of a 30-layer model is ~9 ms of weight streaming and, in the per-module
path, ~6 ms of Python: about 25 module calls and op dispatches per layer (3-4 us each) around
the fused kernels. `decoder_layers` (cpu_ops.cpp) runs the same kernels in the same order from
C++, so a step taken by it gives the same bits as the per-module path with the kernels
installed (tests/kernels/test_fused_stack.py checks exact equality).

This module knows no model: `DecoderStack` is a plain description of the stack (each layer's
tensors, which KV cache each layer uses, windows, head shapes, epsilon, scale) and `run` makes
the native call. The model side (`impasto.models.llama_stack`) builds the description, decides
whether its layers qualify, and asks the step's attention plan whether the fused paged
attention takes the step.

A linear layer's weight is dense bf16 or packed GGUF blocks (`PackedSegments`), computed on by
the kernels' integer-dot matmul (impasto/kernels/quant_ops.cpp), as the per-module path does.

Layer computation (per layer, all norms RMSNorm with one epsilon, no soft-capping):
h = norm(x + residual); qkv = h Wqkv (+b); [q/k per-head norms]; rotary on q, k; paged
attention (writes the cache); o = attn Wo (+b); h, residual = norm(o + residual);
x = down(silu(gate) * up)(h). Returns (the last layer's MLP output, the residual stream).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from typing import Any, Protocol, runtime_checkable

import torch


@runtime_checkable
class PackedSegments(Protocol):
    """A packed GGUF weight as the kernels take it (models' `PackedWeight`): row segments of
    GGML blocks (uint8 [rows, row_bytes], or [rows / 8, group_bytes] interleaved) and their type
    ids (GGML's, | 256 when interleaved)."""

    @property
    def kernel_blocks(self) -> list[torch.Tensor]: ...

    kernel_qtypes: list[int]


Weight = torch.Tensor | PackedSegments  # a linear layer's weight: dense bf16 or packed
LINEAR_FIELDS = ("qkv_weight", "o_weight", "gate_up_weight", "down_weight")  # C++'s order


@dataclass(frozen=True)
class StackLayer:
    """One layer's tensors, in the order of C++'s `enum LayerField` (absent ones None)."""

    input_norm: torch.Tensor
    qkv_weight: Weight
    qkv_bias: torch.Tensor | None
    q_norm: torch.Tensor | None  # Qwen3: per-head RMSNorm on q and k before rotary
    k_norm: torch.Tensor | None
    o_weight: Weight
    o_bias: torch.Tensor | None
    post_norm: torch.Tensor
    gate_up_weight: Weight  # [2I, H]: gate rows, then up rows
    gate_up_bias: torch.Tensor | None
    down_weight: Weight
    down_bias: torch.Tensor | None


@dataclass
class DecoderStack:
    layers: Sequence[StackLayer]
    layer_ids: list[int]  # each layer's index into the step's KV caches
    windows: list[int]  # each layer's sliding window, 0 = none
    num_heads: int
    num_kv_heads: int
    head_dim: int
    eps: float  # every norm's epsilon (q/k norms included)
    scale: float  # attention scale
    weights: list[torch.Tensor | None] = field(init=False)  # all layers' fields, kernel order
    packed: list[torch.Tensor] = field(init=False)  # packed linear weights' segments, in order
    packed_meta: list[int] = field(init=False)  # per layer and linear field: n, then n types

    def __post_init__(self) -> None:
        if not (len(self.layers) == len(self.layer_ids) == len(self.windows)):
            raise ValueError("a decoder stack needs one layer id and one window per layer")
        names = [f.name for f in fields(StackLayer)]  # declaration order = kernel order
        self.weights, self.packed, self.packed_meta = [], [], []
        for layer in self.layers:
            for n in names:
                value = getattr(layer, n)
                self.weights.append(None if isinstance(value, PackedSegments) else value)
            for n in LINEAR_FIELDS:
                value = getattr(layer, n)
                if isinstance(value, PackedSegments):
                    self.packed += value.kernel_blocks
                    self.packed_meta += [len(value.kernel_qtypes), *value.kernel_qtypes]
                else:
                    self.packed_meta.append(0)

    def run(
        self,
        ops: Any,  # the kernels' op namespace (`impasto.kernels.ops()`)
        x: torch.Tensor,  # [T, hidden] embeddings, bf16
        cos_sin: torch.Tensor,  # [2, T, 1, rot_dim] rotary table
        kv_caches: Sequence[torch.Tensor],  # the step's caches, indexed by layer id
        slot_mapping: torch.Tensor,  # [T]
        block_table: torch.Tensor,  # [B, max_blocks]
        query_start_loc: torch.Tensor,  # [B + 1]
        seq_lens: torch.Tensor,  # [B]
        causal: torch.Tensor,  # [B] bool
    ) -> tuple[torch.Tensor, torch.Tensor]:  # (last MLP output, residual stream), [T, hidden]
        caches = [kv_caches[i] for i in self.layer_ids]
        return ops.decoder_layers(
            x, cos_sin, self.weights, self.packed, self.packed_meta, caches, slot_mapping,
            block_table, query_start_loc, seq_lens, causal, self.num_heads, self.num_kv_heads,
            self.head_dim, self.eps, self.scale, self.windows,
        )  # fmt: skip
