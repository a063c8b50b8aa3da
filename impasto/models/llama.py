"""Llama-family decoder (Llama 2/3, SmolLM2, Mistral); Qwen2/Qwen3 subclass it, Gemma 3 reuses
its attention and causal-LM wrapper around its own decoder layers (`gemma3.py`).

Implements `impasto.models.interface.CausalLM`. On bf16 CPU models with the kernels, the
decoder layers may run as one native call on short-query steps (`llama_stack.py`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn
from transformers import PretrainedConfig

from impasto.models.layers import (
    Attention,
    GatedMLP,
    ParallelLMHead,
    QKVParallelLinear,
    RMSNorm,
    RotaryEmbedding,
    VocabParallelEmbedding,
    rope_parameters,
)
from impasto.models.layers.device_hooks import FusedOps
from impasto.models.layers.linear import HeadRowParallelLinear
from impasto.models.layers.parallel import tp_rank, tp_size
from impasto.models.layers.tp_heads import head_layout
from impasto.models.llama_stack import FusedLlamaStack
from impasto.models.weights import load_weights_strict

# (x [T, hidden], cos_sin) -> (last MLP output, residual stream), or None: run per module.
StackFn = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor] | None]


@dataclass(frozen=True)
class AttentionOptions:
    """Per-layer attention variations between the Llama-like architectures."""

    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False  # Qwen3, Gemma 3: RMSNorm over head_dim on q and k before rotary
    gemma_norms: bool = False  # q/k norms are Gemma's x * (1 + w) (weights stored zero-centred)
    sliding_window: int | None = None
    scale: float | None = None  # attention score scale; None: head_dim ** -0.5


def head_dim_of(config: PretrainedConfig) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


class LlamaAttention(nn.Module):
    def __init__(self, config: PretrainedConfig, layer_idx: int, opts: AttentionOptions) -> None:
        super().__init__()
        d = self.head_dim = head_dim_of(config)
        hq, hkv = config.num_attention_heads, config.num_key_value_heads
        layout = head_layout(hq, hkv, tp_rank(), tp_size())  # this rank's heads
        self.num_heads, self.num_kv_heads = len(layout.q_heads), len(layout.kv_heads)
        self.q_size, self.kv_size = self.num_heads * d, self.num_kv_heads * d
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size, d, hq, hkv, bias=opts.qkv_bias, layout=layout
        )
        self.o_proj = HeadRowParallelLinear(layout.q_heads, d, config.hidden_size, bias=opts.o_bias)
        self.qk_norm = opts.qk_norm
        if opts.qk_norm:
            self.q_norm = RMSNorm(d, config.rms_norm_eps, gemma=opts.gemma_norms)
            self.k_norm = RMSNorm(d, config.rms_norm_eps, gemma=opts.gemma_norms)
        self.attn = Attention(
            self.num_heads,
            self.num_kv_heads,
            d,
            layer_idx,
            scale=opts.scale,
            sliding_window=opts.sliding_window,
        )

    def forward(
        self, x: torch.Tensor, cos_sin: torch.Tensor, rotary: RotaryEmbedding
    ) -> torch.Tensor:
        t, d = x.shape[0], self.head_dim
        qkv = self.qkv_proj(x)  # [T, (Hq + 2 Hkv) * D]: q heads, k heads, v heads
        v = qkv[:, self.q_size + self.kv_size :]
        if self.qk_norm:  # per-head RMSNorm before rotary
            q = self.q_norm(qkv[:, : self.q_size].view(t, -1, d))
            k = self.k_norm(qkv[:, self.q_size : self.q_size + self.kv_size].view(t, -1, d))
            q, k = rotary(q, cos_sin, inplace=True), rotary(k, cos_sin, inplace=True)
        else:  # q and k heads are adjacent: one rotary call over [T, Hq + Hkv, D]
            qk = qkv[:, : self.q_size + self.kv_size].view(t, -1, d)
            qk = rotary(qk, cos_sin, inplace=True)  # qkv is this call's own buffer
            q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        return self.o_proj(self.attn(q, k, v))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: PretrainedConfig, layer_idx: int, opts: AttentionOptions) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, layer_idx, opts)
        self.mlp = GatedMLP(
            config.hidden_size,
            config.intermediate_size,
            bias=getattr(config, "mlp_bias", False),
            act=config.hidden_act,
        )
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        cos_sin: torch.Tensor,
        rotary: RotaryEmbedding,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (mlp output, residual stream); the add happens in the next norm."""
        if residual is None:
            x, residual = self.input_layernorm(x), x
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(x, cos_sin, rotary)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class LlamaModel(nn.Module):
    def __init__(self, config: PretrainedConfig, options: list[AttentionOptions]) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, i, opts) for i, opts in enumerate(options)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(head_dim_of(config), rope_parameters(config))
        # Set by `use_kernels` when the whole stack can run as one native call on short-query
        # steps (llama_stack.py).
        self.fused_stack: StackFn | None = None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        cos_sin = self.rotary_emb.cos_sin(positions, x.dtype)  # shared by all layers
        stacked = self.fused_stack(x, cos_sin) if self.fused_stack is not None else None
        if stacked is not None:
            x, residual = stacked
        else:
            residual = None
            for layer in self.layers:
                x, residual = layer(x, residual, cos_sin, self.rotary_emb)
        return self.norm(x, residual)[0]

    def use_kernels(self, ops: FusedOps) -> bool:
        """Device preparation calls it after its layers took the kernels (children first)."""
        self.fused_stack = FusedLlamaStack.build(ops, self)
        return self.fused_stack is not None


class LlamaForCausalLM(nn.Module):
    """Implements `impasto.models.interface.CausalLM`."""

    is_diffusion = False
    # The decoder, built as model_class(config, per-layer AttentionOptions); it must expose
    # `embed_tokens` (tied heads share it) and `layers` of modules with a `self_attn`.
    model_class: ClassVar[type[nn.Module]] = LlamaModel

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.config = config
        self.vocab_size: int = config.vocab_size
        opts = [self.attention_options(config, i) for i in range(config.num_hidden_layers)]
        self.model = self.model_class(config, opts)
        self.tied = bool(getattr(config, "tie_word_embeddings", False))
        tie = self.model.embed_tokens if self.tied else None
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, tie_to=tie)

    @classmethod
    def attention_options(cls, config: PretrainedConfig, layer_idx: int) -> AttentionOptions:
        bias = bool(getattr(config, "attention_bias", False))
        # Mistral: one window for every layer (None = full attention); Llama has none.
        window = getattr(config, "sliding_window", None)
        return AttentionOptions(qkv_bias=bias, o_bias=bias, sliding_window=window)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        load_weights_strict(self, weights, tied_lm_head=self.tied)

    def kv_cache_shapes(self) -> list[tuple[int, int]]:
        return [
            (layer.self_attn.num_kv_heads, layer.self_attn.head_dim) for layer in self.model.layers
        ]


class MistralForCausalLM(LlamaForCausalLM):
    pass
