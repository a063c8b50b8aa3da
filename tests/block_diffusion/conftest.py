"""Tiny block-diffusion checkpoints (SDAR-style Qwen3 without shift, Fast-dLLM-v2-style Qwen2
with token shift, block sizes 4 and 8) and their reference models."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest

from impasto.testing.block_diffusion import build_block_checkpoint, load_reference_model
from tests.fixtures import one_torch_thread

__all__ = ["one_torch_thread"]

# (flavour, block size): the parametrisation every engine test runs over.
KINDS = [("sdar", 4), ("sdar", 8), ("fast_dllm", 4), ("fast_dllm", 8)]


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory) -> dict[tuple[str, int], Path]:
    return {
        (flavour, b): build_block_checkpoint(
            tmp_path_factory.mktemp(f"{flavour}{b}"), flavour, b, seed=b
        )
        for flavour, b in KINDS
    }


@functools.cache
def reference_model(path: Path):
    return load_reference_model(path)


def make_llm(path: Path, **kwargs):
    from impasto.entrypoints.llm import LLM

    defaults = dict(
        skip_tokenizer_init=True, dtype="float32", device="cpu", block_size=16, max_model_len=256
    )
    return LLM(str(path), **{**defaults, **kwargs})
