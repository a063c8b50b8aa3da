"""Tiny random DiffusionGemma checkpoints built with transformers itself (fp32, fixed seed)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

# A vision tower is part of every HF DiffusionGemma; keep it minimal (it is never loaded).
TINY_VISION: dict[str, Any] = dict(
    model_type="gemma4_vision",
    hidden_size=8,
    intermediate_size=8,
    num_hidden_layers=1,
    num_attention_heads=1,
    num_key_value_heads=1,
    head_dim=8,
    position_embedding_size=4,
)

TINY_TEXT: dict[str, Any] = dict(
    vocab_size=160,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    global_head_dim=32,
    num_global_key_value_heads=1,
    sliding_window=8,
    layer_types=["sliding_attention", "full_attention", "full_attention"],
    num_experts=4,
    top_k_experts=2,
    moe_intermediate_size=32,
    max_position_embeddings=1024,
    eos_token_id=1,
    pad_token_id=0,
    bos_token_id=2,
)


def make_config(canvas_length: int = 16, **text: Any):
    from transformers.models.diffusion_gemma import DiffusionGemmaConfig

    cfg = DiffusionGemmaConfig(
        text_config={**TINY_TEXT, **text},
        vision_config=TINY_VISION,
        canvas_length=canvas_length,
    )
    cfg.architectures = ["DiffusionGemmaForBlockDiffusion"]
    return cfg


def build_model(seed: int = 0, canvas_length: int = 16, **text: Any):
    from transformers.models.diffusion_gemma import DiffusionGemmaForBlockDiffusion

    torch.manual_seed(seed)
    model = DiffusionGemmaForBlockDiffusion(make_config(canvas_length, **text)).float().eval()
    with torch.no_grad():  # sharp, non-degenerate random weights
        for name, p in model.named_parameters():
            if "vision" in name:
                continue
            if "norm" in name or name.endswith("scale"):
                p.normal_(1.0, 0.1)
            elif "self_conditioning" in name:
                # A trained model's self-conditioning loop is contractive; strong random
                # weights would amplify float noise ~10x per denoising step.
                p.normal_(0.0, 0.02)
            else:
                p.normal_(0.0, 0.15)
    return model


def build_checkpoint(path: Path, seed: int = 0, canvas_length: int = 16, **text: Any) -> Path:
    model = build_model(seed, canvas_length, **text)
    model.save_pretrained(path)
    return path
