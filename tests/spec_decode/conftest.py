"""Tiny random checkpoints (built with transformers) and an LLM runner for speculation tests."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from impasto import LLM, SamplingParams
from tests.entrypoints.conftest import build_checkpoint

# One thread: the tiny models' matmuls are far cheaper than a thread hand-off.
BASE_ARGS = dict(
    dtype="float32", skip_tokenizer_init=True, block_size=4, max_num_seqs=8, num_threads=1
)


@pytest.fixture(autouse=True)
def _restore_torch_threads():
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> Path:
    return build_checkpoint(tmp_path_factory.mktemp("spec_llama"), "llama")


@pytest.fixture(scope="session")
def tiny_qwen2(tmp_path_factory) -> Path:
    return build_checkpoint(tmp_path_factory.mktemp("spec_qwen2"), "qwen2")


@pytest.fixture(scope="session")
def tiny_draft(tmp_path_factory) -> Path:
    """A different (smaller) model with the same vocabulary: a draft that is often wrong."""
    return build_checkpoint(
        tmp_path_factory.mktemp("spec_draft"), "llama", num_hidden_layers=1, hidden_size=32
    )


def make_llm(path: Path, **kwargs) -> LLM:
    args = dict(BASE_ARGS)
    args.update(kwargs)
    return LLM(str(path), **args)


def generate(
    llm: LLM, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]
) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def metrics(llm: LLM) -> dict[str, float]:
    return {m.name: m.value for m in llm.get_metrics()}
