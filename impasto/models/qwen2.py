"""Qwen2 / Qwen2.5: Llama with biased q/k/v projections and per-layer sliding windows."""

from __future__ import annotations

from transformers import PretrainedConfig

from impasto.models.llama import AttentionOptions, LlamaForCausalLM


def layer_window(config: PretrainedConfig, layer_idx: int) -> int | None:
    """`sliding_window` applies only to layers typed "sliding_attention" (HF `layer_types`)."""
    types = getattr(config, "layer_types", None)
    window = getattr(config, "sliding_window", None)
    if types is None or window is None:
        return None
    return window if types[layer_idx] == "sliding_attention" else None


class Qwen2ForCausalLM(LlamaForCausalLM):
    @classmethod
    def attention_options(cls, config: PretrainedConfig, layer_idx: int) -> AttentionOptions:
        return AttentionOptions(qkv_bias=True, sliding_window=layer_window(config, layer_idx))
