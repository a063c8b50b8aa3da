"""Tiny random HF checkpoints built with transformers itself (fixed seed, safetensors)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import (
    AutoModelForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    MistralConfig,
    Qwen2Config,
    Qwen3Config,
)

CONFIGS = {
    "llama": LlamaConfig,
    "mistral": MistralConfig,
    "qwen2": Qwen2Config,
    "qwen3": Qwen3Config,
    "gemma3": Gemma3TextConfig,
}

TINY: dict[str, Any] = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=256,
    max_position_embeddings=256,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)


def build_checkpoint(
    path: Path, kind: str, seed: int = 0, *, init_scale: float | None = None, **overrides: Any
) -> Path:
    """Random weights large enough (std 0.15) that attention patterns and argmaxes are sharp.

    `init_scale`: keep transformers' own initialisation and scale its matrices by this factor
    instead (the engine-level tests' checkpoints, see `tests/entrypoints/conftest.py`).
    """
    shard_size = overrides.pop("max_shard_size", "2GB")
    torch.manual_seed(seed)
    config = CONFIGS[kind](**{**TINY, **overrides})
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if init_scale is not None:
                if p.dim() == 2:
                    p.mul_(init_scale)
            elif "norm" in name:
                p.normal_(1.0, 0.1)
            else:
                p.normal_(0.0, 0.15)
    model.save_pretrained(path, max_shard_size=shard_size)
    return path


def hf_model(path: Path, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(
        path, dtype=dtype, attn_implementation="eager", local_files_only=True
    ).eval()


@torch.inference_mode()
def hf_greedy(model: torch.nn.Module, prompt: list[int], max_new: int) -> list[int]:
    """Greedy decoding by full recomputation (no HF cache involved)."""
    ids = torch.tensor([prompt])
    out: list[int] = []
    for _ in range(max_new):
        tok = int(model(ids).logits[0, -1].argmax())
        out.append(tok)
        ids = torch.cat([ids, torch.tensor([[tok]])], dim=1)
    return out
