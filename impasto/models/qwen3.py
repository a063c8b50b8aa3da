"""Qwen3 (dense): Llama with per-head RMSNorm on q and k, optional attention bias."""

from __future__ import annotations

from transformers import PretrainedConfig

from impasto.models.llama import AttentionOptions, LlamaForCausalLM
from impasto.models.qwen2 import layer_window


class Qwen3ForCausalLM(LlamaForCausalLM):
    @classmethod
    def attention_options(cls, config: PretrainedConfig, layer_idx: int) -> AttentionOptions:
        bias = bool(getattr(config, "attention_bias", False))
        window = layer_window(config, layer_idx)
        return AttentionOptions(qkv_bias=bias, o_bias=bias, qk_norm=True, sliding_window=window)
