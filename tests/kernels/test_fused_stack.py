"""The whole-stack decoder call (kernels/decoder_stack.py, models/llama_stack.py) against the
per-module kernel path.

Both run the same kernels in the same order, so greedy tokens and logprobs must be identical,
bit for bit, on decode and speculative-verification steps of every Llama-family variant.
The engines run with oneDNN weight packing off: packed weights make the stack ineligible, and
whether a CPU can pack must not decide what this tests.
"""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from impasto import LLM, SamplingParams, kernels
from impasto.models.llama_stack import FusedLlamaStack, unsupported_reason
from tests.models.checkpoints import build_checkpoint

HAVE_COMPILER = shutil.which(os.environ.get("CXX", "c++")) is not None
pytestmark = pytest.mark.skipif(not HAVE_COMPILER, reason="no C++ compiler for the CPU kernels")

VARIANTS = {
    "llama-gqa-tied": ("llama", dict(tie_word_embeddings=True)),
    "mistral-window": ("mistral", dict(sliding_window=7, tie_word_embeddings=False)),
    "qwen2-bias-window-layers": (
        "qwen2",
        dict(use_sliding_window=True, sliding_window=6, max_window_layers=1),
    ),
    "qwen3-qknorm": ("qwen3", dict(head_dim=32, tie_word_embeddings=False)),
}

PROMPTS = [[5, 17, 99], [1, 200, 31, 64, 8, 9, 120, 77, 3, 45, 46], [7, 8, 9] * 6 + [30, 31]]


class Counting:
    """Wraps a FusedLlamaStack and counts the steps it took."""

    def __init__(self, stack: FusedLlamaStack) -> None:
        self.stack, self.steps = stack, 0

    def __call__(self, x, cos_sin):
        out = self.stack(x, cos_sin)
        self.steps += out is not None
        return out


@pytest.fixture(autouse=True)
def no_weight_packing(monkeypatch):
    monkeypatch.setenv("IMPASTO_CPU_PACKED_WEIGHTS", "0")  # see the module docstring


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def checkpoint(request, tmp_path_factory):
    kind, overrides = VARIANTS[request.param]
    return build_checkpoint(tmp_path_factory.mktemp(request.param), kind, **overrides)


def _generate(path, *, stack: bool, **engine_args):
    llm = LLM(
        str(path), dtype="bfloat16", skip_tokenizer_init=True, block_size=4,
        num_gpu_blocks_override=64, max_model_len=128, seed=0, **engine_args,
    )  # fmt: skip
    inner = llm.llm_engine.runner.model.model
    assert inner.fused_stack is not None, "the stack should be eligible for this model"
    counter = Counting(inner.fused_stack)
    inner.fused_stack = counter if stack else None
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=2)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    result = [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]
    return result, counter.steps


@pytest.mark.parametrize(
    "engine_args",
    [{}, {"speculative_config": {"method": "ngram", "num_speculative_tokens": 3}}],
    ids=["decode", "ngram-verify"],
)
def test_stack_gives_the_per_module_bits(checkpoint, engine_args):
    got, steps = _generate(checkpoint, stack=True, **engine_args)
    want, _ = _generate(checkpoint, stack=False, **engine_args)
    if engine_args:  # verification steps: how many depends on the n-gram proposals
        assert steps > 0, "no step took the fused stack"
    else:  # one step prefills all prompts per module (and samples their first token); the
        assert steps == 15  # 15 decode steps that follow go through the stack
    for (tokens, logprobs), (ref_tokens, ref_logprobs) in zip(got, want, strict=True):
        assert tokens == ref_tokens
        for a, b in zip(logprobs, ref_logprobs, strict=True):
            assert {t: lp.logprob for t, lp in a.items()} == {t: lp.logprob for t, lp in b.items()}


def test_unsupported_models_keep_the_per_module_path(tmp_path):
    path = build_checkpoint(tmp_path / "llama", "llama")
    fp32 = LLM(str(path), dtype="float32", skip_tokenizer_init=True, max_model_len=64)
    assert fp32.llm_engine.runner.model.model.fused_stack is None  # kernels serve bf16 only
    bf16 = LLM(str(path), dtype="bfloat16", skip_tokenizer_init=True, max_model_len=64)
    inner = bf16.llm_engine.runner.model.model
    ops = kernels.ops()
    assert unsupported_reason(ops, inner) is None
    inner.layers[1].mlp.down_proj.linear = torch.nn.functional.linear  # e.g. a packed weight
    assert "linear" in unsupported_reason(ops, inner)
    inner.layers[0].input_layernorm.eps = 1e-3
    assert "norms" in unsupported_reason(ops, inner)
