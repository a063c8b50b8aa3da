"""The Llama-family side of the whole-stack decode path (`impasto.kernels.decoder_stack`).

It describes a `LlamaModel`'s decoder layers to the kernel (weights in kernel order, layer
ids, windows, head shapes, epsilon, scale), decides once whether they qualify, and per step
whether the step does.

Taken when, and only when, every condition of the per-module kernel path holds for the whole
stack: bf16 activations on CPU, linear weights read by the skinny bf16 GEMM (not oneDNN-packed,
see packed.py) or by the packed GGUF matmul (quantized.py), SiLU
MLPs, plain (non-Gemma) RMSNorms sharing one epsilon, no logit soft-capping, one rank; and per
step: the step's attention plan says the fused paged attention takes it (every request a
short query whose keys are all written, a bf16 CPU cache; `AttentionPlan.fused_short_queries`)
and the step has at most FUSED_SILU_MAX_ROWS rows (above that the per-module MLP runs SiLU
eagerly, and Python overhead no longer dominates anyway). Any other step runs per module.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from impasto.attention.metadata import get_forward_context
from impasto.kernels.decoder_stack import DecoderStack, StackLayer
from impasto.models.layers.device_hooks import FusedOps
from impasto.models.layers.mlp import FUSED_SILU_MAX_ROWS
from impasto.models.layers.parallel import tp_size
from impasto.models.layers.quantized import KernelPackedLinear

if TYPE_CHECKING:
    from impasto.models.llama import LlamaDecoderLayer, LlamaModel

logger = logging.getLogger(__name__)


def _stack_layer(layer: LlamaDecoderLayer) -> StackLayer:
    attn, mlp = layer.self_attn, layer.mlp
    return StackLayer(
        input_norm=layer.input_layernorm.weight,
        qkv_weight=attn.qkv_proj.weight,
        qkv_bias=attn.qkv_proj.bias,
        q_norm=attn.q_norm.weight if attn.qk_norm else None,
        k_norm=attn.k_norm.weight if attn.qk_norm else None,
        o_weight=attn.o_proj.weight,
        o_bias=attn.o_proj.bias,
        post_norm=layer.post_attention_layernorm.weight,
        gate_up_weight=mlp.gate_up_proj.weight,
        gate_up_bias=mlp.gate_up_proj.bias,
        down_weight=mlp.down_proj.weight,
        down_bias=mlp.down_proj.bias,
    )


def unsupported_reason(ops: FusedOps, model: LlamaModel) -> str | None:
    """Why `model`'s layers cannot run as one stack (None: they can). Whether the attention
    backend's fused kernel applies is asked per step."""
    if tp_size() != 1:
        return "tensor parallelism"
    layers = list(model.layers)
    if not layers:
        return "no layers"
    attns = [layer.self_attn for layer in layers]
    norms = [layer.input_layernorm for layer in layers]
    norms += [layer.post_attention_layernorm for layer in layers]
    norms += [n for a in attns if a.qk_norm for n in (a.q_norm, a.k_norm)]
    if any(n.fused_ops is None or n.gemma for n in norms) or len({n.eps for n in norms}) != 1:
        return "norms differ or are not fused"
    if model.rotary_emb.fused_ops is None:
        return "rotary not fused"
    if any(layer.mlp.fused_ops is None for layer in layers):
        return "MLP not fused"
    linears = [m for a in attns for m in (a.qkv_proj, a.o_proj)]
    linears += [m for layer in layers for m in (layer.mlp.gate_up_proj, layer.mlp.down_proj)]
    if any(m.linear is not ops.linear_bf16 and not isinstance(m.linear, KernelPackedLinear)
           for m in linears):  # fmt: skip
        return "linear weights neither on the skinny bf16 GEMM nor packed GGUF (oneDNN or fp32)"
    shapes = {(a.num_heads, a.num_kv_heads, a.head_dim, a.attn.scale) for a in attns}
    if len(shapes) != 1:
        return "layers differ in head shapes"
    if any(a.attn.logit_softcap is not None for a in attns):
        return "logit soft-capping"
    return None


def describe(model: LlamaModel) -> DecoderStack:
    """The kernel's description of `model`'s decoder layers (eligible ones: see above)."""
    layers = list(model.layers)
    attn0 = layers[0].self_attn
    return DecoderStack(
        layers=[_stack_layer(layer) for layer in layers],
        layer_ids=[layer.self_attn.attn.layer_idx for layer in layers],
        windows=[layer.self_attn.attn.sliding_window or 0 for layer in layers],
        num_heads=attn0.num_heads,
        num_kv_heads=attn0.num_kv_heads,
        head_dim=attn0.head_dim,
        eps=float(layers[0].input_layernorm.eps),
        scale=float(attn0.attn.scale),
    )


class FusedLlamaStack:
    """Runs a LlamaModel's decoder layers as one native call on the steps that allow it."""

    def __init__(self, ops: FusedOps, stack: DecoderStack) -> None:
        self.ops, self.stack = ops, stack

    @classmethod
    def build(cls, ops: FusedOps, model: LlamaModel) -> FusedLlamaStack | None:
        reason = unsupported_reason(ops, model)
        if reason is not None:
            logger.info("decoder layers run per module (%s)", reason)
            return None
        return cls(ops, describe(model))

    def __call__(
        self, x: torch.Tensor, cos_sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """x [T, hidden] embeddings -> (last MLP output, residual stream), or None when this
        step must run per module."""
        if x.shape[0] > FUSED_SILU_MAX_ROWS:  # the MLP's own limit for its fused SiLU
            return None
        ctx = get_forward_context()
        causal = ctx.plan.fused_short_queries(ctx.kv_caches[self.stack.layer_ids[0]], x.dtype)
        if causal is None:
            return None  # the attention layers would not take their fused kernel either
        meta = ctx.metadata
        return self.stack.run(
            self.ops, x, cos_sin, ctx.kv_caches, meta.slot_mapping, meta.block_table,
            meta.query_start_loc, meta.seq_lens_t, causal,
        )  # fmt: skip
