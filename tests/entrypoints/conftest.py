"""Tiny random checkpoints built with transformers itself, saved as HF folders."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest

from tests.models import checkpoints

# The engine tests' flavour of the tiny checkpoints: a 160-token vocabulary, transformers' own
# initialisation with its matrices scaled by 3 (peaked, non-degenerate greedy paths), and the
# architectures' default special-token ids. Tests tuned to these weights (e.g. the spec-decode
# distribution test's acceptance window) depend on every one of these settings.
ENGINE_TINY = dict(vocab_size=160, bos_token_id=None, eos_token_id=None, pad_token_id=None)
DEFAULT_SPECIAL_IDS = {"llama": dict(bos_token_id=1, eos_token_id=2)}


def build_checkpoint(path: Path, kind: str, **overrides) -> Path:
    extra = {**ENGINE_TINY, **DEFAULT_SPECIAL_IDS.get(kind, {})}
    if kind == "qwen3":
        extra["head_dim"] = 16
    return checkpoints.build_checkpoint(path, kind, init_scale=3.0, **{**extra, **overrides})


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> Path:
    return build_checkpoint(tmp_path_factory.mktemp("llama"), "llama")


@functools.cache
def _hf_model(path: Path):
    return checkpoints.hf_model(path)


def hf_greedy(path: Path, prompt: list[int], max_tokens: int) -> list[int]:
    """Reference greedy decoding with the HF model, no KV cache (full recompute)."""
    return checkpoints.hf_greedy(_hf_model(path), prompt, max_tokens)
