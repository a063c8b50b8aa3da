"""Shared fixtures: tiny DiffusionGemma checkpoints and engines over them."""

from __future__ import annotations

from pathlib import Path

import pytest

from .checkpoints import build_checkpoint

CANVAS = 16


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny models: one intra-op thread is as fast, and does not stall on a busy machine."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tiny_dg(tmp_path_factory) -> Path:
    """3 layers (sliding + full), MoE, canvas 16, window 64 (< the longer prompts)."""
    return build_checkpoint(tmp_path_factory.mktemp("dg"), seed=0, sliding_window=64)


@pytest.fixture(scope="session")
def micro_dg(tmp_path_factory) -> Path:
    """A smaller model for long soak runs (1 sliding + 1 full layer)."""
    return build_checkpoint(
        tmp_path_factory.mktemp("dg_micro"),
        seed=1,
        hidden_size=32,
        intermediate_size=32,
        num_hidden_layers=2,
        layer_types=["sliding_attention", "full_attention"],
        vocab_size=64,
        moe_intermediate_size=16,
        sliding_window=16,
    )


def make_llm(path: Path, **kwargs):
    from impasto.entrypoints.llm import LLM

    defaults = dict(
        skip_tokenizer_init=True,
        dtype="float32",
        device="cpu",
        block_size=16,
        max_model_len=512,
        diffusion_config={"max_denoising_steps": 6},
    )
    return LLM(str(path), **{**defaults, **kwargs})
