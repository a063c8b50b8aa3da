"""Gemma 3 text decoder (HF `Gemma3ForCausalLM`, config `Gemma3TextConfig`).

What differs from Llama, all as in transformers' `modeling_gemma3.py`:
- embeddings are multiplied by sqrt(hidden_size), rounded to the model dtype first (HF keeps
  the factor as a float32 tensor and casts it to the weight dtype before the product);
- every RMSNorm is Gemma's `x * (1 + w)` in float32, weights stored zero-centred; a layer has
  four (before and after attention, before and after the MLP), q and k one each per head;
- attention scores are scaled by query_pre_attn_scalar ** -0.5, not head_dim ** -0.5;
- the MLP is gated tanh-GELU;
- layers typed "sliding_attention" (5 of every 6 by default) see the last `sliding_window`
  positions and use their own rotary base (10000, no scaling); "full_attention" layers use the
  global base with its scaling (HF `rope_parameters[layer_type]`);
- `final_logit_softcapping`, when set, caps the logits. `attn_logit_softcapping` is ignored:
  transformers' Gemma 3 never applies it (neither does llama.cpp, whose converter refuses a
  Gemma 3 checkpoint that sets it).

Invariants: the residual stream is carried un-added between layers like Llama's (the add is
fused into the next norm), which changes no value; the decoder never runs as the fused Llama
stack (Gemma norms and GELU are not what that kernel computes).
"""

from __future__ import annotations

from typing import Any, cast

import torch
from torch import nn
from transformers import PretrainedConfig

from impasto.models.layers import GatedMLP, RMSNorm, RotaryEmbedding, VocabParallelEmbedding
from impasto.models.llama import AttentionOptions, LlamaAttention, LlamaForCausalLM, head_dim_of


def layer_rope(config: PretrainedConfig, layer_type: str) -> dict[str, Any]:
    """The rotary parameters of one layer type (transformers keys them by type for Gemma 3)."""
    params = config.rope_parameters or {}
    if layer_type not in params:
        raise ValueError(f"Gemma 3 config has no rope_parameters for {layer_type!r} layers")
    return dict(params[layer_type])


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, config: PretrainedConfig, layer_idx: int, opts: AttentionOptions) -> None:
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn = LlamaAttention(config, layer_idx, opts)
        self.mlp = GatedMLP(h, config.intermediate_size, act=config.hidden_activation)
        self.input_layernorm = RMSNorm(h, eps, gemma=True)
        self.post_attention_layernorm = RMSNorm(h, eps, gemma=True)
        self.pre_feedforward_layernorm = RMSNorm(h, eps, gemma=True)
        self.post_feedforward_layernorm = RMSNorm(h, eps, gemma=True)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        cos_sin: torch.Tensor,
        rotary: RotaryEmbedding,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (normed MLP output, residual stream); the add happens in the next norm."""
        if residual is None:
            x, residual = self.input_layernorm(x), x
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.post_attention_layernorm(self.self_attn(x, cos_sin, rotary))
        x, residual = self.pre_feedforward_layernorm(x, residual)  # residual += attention
        return self.post_feedforward_layernorm(self.mlp(x)), residual


class Gemma3Model(nn.Module):
    def __init__(self, config: PretrainedConfig, options: list[AttentionOptions]) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.embed_scale = float(config.hidden_size) ** 0.5
        self.layers = nn.ModuleList(
            Gemma3DecoderLayer(config, i, opts) for i, opts in enumerate(options)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, gemma=True)
        self.layer_types: list[str] = list(config.layer_types)
        d = head_dim_of(config)
        self.rotary = nn.ModuleDict(
            {t: RotaryEmbedding(d, layer_rope(config, t)) for t in sorted(set(self.layer_types))}
        )

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        # HF rounds the float32 factor to the weight dtype, then multiplies (bf16: 25.25, not 25.3)
        x = x * torch.tensor(self.embed_scale, dtype=torch.float32).to(x.dtype)
        rotary = cast(dict[str, RotaryEmbedding], self.rotary)
        cos_sin = {t: r.cos_sin(positions, x.dtype) for t, r in rotary.items()}  # once per type
        residual = None
        for layer, kind in zip(self.layers, self.layer_types, strict=True):
            x, residual = layer(x, residual, cos_sin[kind], rotary[kind])
        return self.norm(x, residual)[0]


class Gemma3ForCausalLM(LlamaForCausalLM):
    """Implements `impasto.models.interface.CausalLM`."""

    model_class = Gemma3Model

    def __init__(self, config: PretrainedConfig) -> None:
        if getattr(config, "use_bidirectional_attention", False):
            raise NotImplementedError("Gemma 3 with bidirectional attention is not supported")
        super().__init__(config)
        self.softcap: float | None = getattr(config, "final_logit_softcapping", None)

    @classmethod
    def attention_options(cls, config: PretrainedConfig, layer_idx: int) -> AttentionOptions:
        bias = bool(getattr(config, "attention_bias", False))
        sliding = config.layer_types[layer_idx] == "sliding_attention"
        return AttentionOptions(
            qkv_bias=bias,
            o_bias=bias,
            qk_norm=True,
            gemma_norms=True,
            sliding_window=config.sliding_window if sliding else None,
            scale=float(config.query_pre_attn_scalar) ** -0.5,
        )

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden)  # float32, this call's own tensor: capped in place
        if self.softcap:
            logits = logits.div_(self.softcap).tanh_().mul_(self.softcap)
        return logits
