"""All decoder layers of a Llama-family model in one native call, for short-query steps.

A batch-1 decode step of a 30-layer model is ~9 ms of weight streaming and, in the per-module
path, ~6 ms of Python: about 25 module calls and op dispatches per layer (3-4 us each) around
the fused kernels. `decoder_layers` (kernels/cpu_ops.cpp) runs the same kernels in the same
order from C++, so a step taken by it gives the same bits as the per-module path with the
kernels installed (tests/kernels/test_fused_stack.py checks exact equality).

Taken when, and only when, every condition of the per-module kernel path holds for the whole
stack: bf16 weights on CPU read by the skinny GEMM (not oneDNN-packed, see packed.py), SiLU
MLPs, plain (non-Gemma) RMSNorms sharing one epsilon, no logit soft-capping, one rank; and per
step: every request is a short query whose keys are all written (the fused attention's case)
and the step has at most FUSED_SILU_MAX_ROWS rows (above that the per-module MLP runs SiLU
eagerly, and Python overhead no longer dominates anyway). Any other step runs per module.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch

from impasto.attention.metadata import get_forward_context
from impasto.attention.torch_backend import TorchAttentionBackend
from impasto.models.layers.mlp import FUSED_SILU_MAX_ROWS
from impasto.models.layers.parallel import tp_size

if TYPE_CHECKING:
    from impasto.models.llama import LlamaDecoderLayer, LlamaModel

logger = logging.getLogger(__name__)


def _layer_weights(layer: LlamaDecoderLayer) -> list[torch.Tensor | None]:
    """One layer's entries of the `weights` list, in the order of C++'s enum LayerField."""
    attn, mlp = layer.self_attn, layer.mlp
    qk = (attn.q_norm.weight, attn.k_norm.weight) if attn.qk_norm else (None, None)
    return [
        layer.input_layernorm.weight,
        attn.qkv_proj.weight, attn.qkv_proj.bias,
        *qk,
        attn.o_proj.weight, attn.o_proj.bias,
        layer.post_attention_layernorm.weight,
        mlp.gate_up_proj.weight, mlp.gate_up_proj.bias,
        mlp.down_proj.weight, mlp.down_proj.bias,
    ]  # fmt: skip


def unsupported_reason(ops: Any, model: LlamaModel) -> str | None:
    """Why `model`'s layers cannot run as one stack (None: they can)."""
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
    if any(m.linear is not ops.linear_bf16 for m in linears):
        return "linear weights not on the skinny bf16 GEMM (packed or not bf16)"
    shapes = {(a.num_heads, a.num_kv_heads, a.head_dim, a.attn.scale) for a in attns}
    if len(shapes) != 1:
        return "layers differ in head shapes"
    if any(a.attn.logit_softcap is not None for a in attns):
        return "logit soft-capping"
    if len({id(a.attn.backend) for a in attns}) != 1 or not isinstance(
        attns[0].attn.backend, TorchAttentionBackend
    ):
        return "attention backend"  # (whether its fused kernel applies is asked per step)
    return None


class FusedDecoderStack:
    def __init__(self, ops: Any, model: LlamaModel) -> None:
        layers = list(model.layers)
        attn0 = layers[0].self_attn
        self.ops = ops
        self.backend: TorchAttentionBackend = attn0.attn.backend
        self.weights = [w for layer in layers for w in _layer_weights(layer)]
        self.layer_ids = [layer.self_attn.attn.layer_idx for layer in layers]
        self.windows = [layer.self_attn.attn.sliding_window or 0 for layer in layers]
        self.heads = (attn0.num_heads, attn0.num_kv_heads, attn0.head_dim)
        self.eps = float(layers[0].input_layernorm.eps)
        self.scale = float(attn0.attn.scale)

    @classmethod
    def build(cls, ops: Any, model: LlamaModel) -> FusedDecoderStack | None:
        reason = unsupported_reason(ops, model)
        if reason is not None:
            logger.info("decoder layers run per module (%s)", reason)
            return None
        return cls(ops, model)

    def __call__(
        self, x: torch.Tensor, cos_sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """x [T, hidden] embeddings -> (last MLP output, residual stream), or None when this
        step must run per module."""
        if x.shape[0] > FUSED_SILU_MAX_ROWS:  # the MLP's own limit for its fused SiLU
            return None
        ctx = get_forward_context()
        meta = ctx.metadata
        caches = [ctx.kv_caches[i] for i in self.layer_ids]
        plan = self.backend.plan(meta)
        if self.backend.fused_kernel(plan, caches[0], x.dtype) is None:
            return None  # the attention layers would not take their fused kernel either
        hq, hkv, d = self.heads
        return self.ops.decoder_layers(
            x, cos_sin, self.weights, caches, meta.slot_mapping, meta.block_table,
            meta.query_start_loc, meta.seq_lens_t, plan.causal_t,
            hq, hkv, d, self.eps, self.scale, self.windows,
        )  # fmt: skip
