"""Shared fixtures: tiny DiffusionGemma checkpoints and engines over them."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.fixtures import one_torch_thread

from .checkpoints import build_checkpoint

__all__ = ["one_torch_thread"]

CANVAS = 16


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
