"""Tiny random checkpoints built with transformers itself, saved as HF folders."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch


def build_checkpoint(path: Path, kind: str, **overrides) -> Path:
    import transformers as tf

    common = dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=160,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
    )
    common.update(overrides)
    if kind == "llama":
        config, cls = tf.LlamaConfig(**common), tf.LlamaForCausalLM
    elif kind == "qwen2":
        config, cls = tf.Qwen2Config(**common), tf.Qwen2ForCausalLM
    elif kind == "qwen3":
        config, cls = tf.Qwen3Config(head_dim=16, **common), tf.Qwen3ForCausalLM
    else:
        raise ValueError(kind)
    torch.manual_seed(0)
    model = cls(config).to(torch.float32).eval()
    # Larger weights than the default init give peaked, non-degenerate greedy paths.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(3.0)
    model.save_pretrained(path, safe_serialization=True)
    return path


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> Path:
    return build_checkpoint(tmp_path_factory.mktemp("llama"), "llama")


@functools.cache
def _hf_model(path: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def hf_greedy(path: Path, prompt: list[int], max_tokens: int) -> list[int]:
    """Reference greedy decoding with the HF model, no KV cache (full recompute)."""
    model = _hf_model(path)
    ids = torch.tensor([prompt])
    out = []
    with torch.no_grad():
        for _ in range(max_tokens):
            nxt = int(model(ids).logits[0, -1].argmax())
            out.append(nxt)
            ids = torch.cat([ids, torch.tensor([[nxt]])], dim=1)
    return out
