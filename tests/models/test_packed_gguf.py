"""Packed GGUF weights in whole models: what loads packed, and that everything which must not
change outputs still does not (prefix caching, chunked prefill, preemption, batch composition,
the fused decoder stack, speculative decoding): exact greedy equality with and without each.

The checkpoints are tiny random Llama / Qwen2 models written as GGUF files the way llama.cpp's
converter writes them, with the mixes of types real Q4_K_M / Q4_1 files have (a q/k/v
projection of Q4_K and Q6_K rows, Q5_0 / Q8_0 / Q4_1 elsewhere, a Q8_0 table).
"""

from __future__ import annotations

import os
import random
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from safetensors.torch import load_file
from transformers import AutoConfig

from impasto import LLM, SamplingParams
from impasto.loader.gguf_loader import gguf_to_hf_config
from impasto.models.layers.quantized import (
    KernelFloatPackedLinear,
    KernelPackedLinear,
    PackedWeight,
)
from tests.loader.gguf_testutil import write_gguf
from tests.models.checkpoints import build_checkpoint

HAVE_COMPILER = shutil.which(os.environ.get("CXX", "c++")) is not None
KERNEL_LINEARS = (KernelPackedLinear, KernelFloatPackedLinear)
MAX_TOKENS = 10
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)

# (HF kind, config overrides, GGML type per projection). K-quants need rows of 256 values.
VARIANTS = {
    "llama-kquants-tied": (
        "llama",
        dict(hidden_size=256, intermediate_size=512, num_attention_heads=4,
             num_key_value_heads=2, tie_word_embeddings=True),
        {"q_proj": Q.Q4_K, "k_proj": Q.Q4_K, "v_proj": Q.Q6_K, "o_proj": Q.Q4_K,
         "gate_proj": Q.Q4_K, "up_proj": Q.Q4_K, "down_proj": Q.Q6_K, "embed_tokens": Q.Q8_0},
    ),
    "qwen2-32blocks-untied": (
        "qwen2",
        dict(tie_word_embeddings=False, head_dim=16),
        {"q_proj": Q.Q5_0, "k_proj": Q.Q5_0, "v_proj": Q.Q8_0, "o_proj": Q.Q4_1,
         "gate_proj": Q.Q4_0, "up_proj": Q.Q5_1, "down_proj": Q.Q8_0, "embed_tokens": Q.Q5_0,
         "lm_head": Q.Q8_0},
    ),
}  # fmt: skip
CONFIGS = {
    "prefix-cache": dict(enable_prefix_caching=True),
    "small-chunks": dict(enable_prefix_caching=True, max_num_batched_tokens=7),
    "preemption": dict(enable_prefix_caching=True, num_gpu_blocks_override=18, max_model_len=64),
    "no-chunking": dict(enable_prefix_caching=False, enable_chunked_prefill=False),
}


def write_packed_gguf(root: Path, kind: str, overrides: dict, types: dict[str, Q]) -> Path:
    hf = build_checkpoint(root / "hf", kind, init_scale=3.0, vocab_size=160, **overrides)
    state = load_file(str(hf / "model.safetensors"))
    parts = {name: name.split(".")[-2] for name in state if name.endswith(".weight")}
    qtypes = {name: types[part] for name, part in parts.items() if part in types}
    path = root / "model.gguf"
    write_gguf(path, kind, AutoConfig.from_pretrained(hf), state, qtypes)
    return path


@pytest.fixture(scope="module", params=list(VARIANTS))
def packed_gguf(request, tmp_path_factory) -> Path:
    kind, overrides, types = VARIANTS[request.param]
    return write_packed_gguf(tmp_path_factory.mktemp(request.param), kind, overrides, types)


def prompts(vocab: int = 160) -> list[list[int]]:
    rng = random.Random(0)
    shared = [rng.randrange(vocab) for _ in range(13)]
    out = [shared + [rng.randrange(vocab) for _ in range(n)] for n in (0, 3, 20, 31)]
    out += [[rng.randrange(vocab) for _ in range(n)] for n in (1, 5, 17)]
    out.append(list(out[2]))  # a full prefix hit
    return out


def make_llm(path: Path, **kwargs) -> LLM:
    args = dict(dtype="float32", skip_tokenizer_init=True, block_size=4, max_num_seqs=8)
    args.update(kwargs)
    return LLM(str(path), **args)


def generate(llm: LLM, ps: list[list[int]]) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in ps], GREEDY, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def model_of(llm: LLM) -> torch.nn.Module:
    return llm.llm_engine.runner.model


def test_matrices_load_packed_without_a_dense_copy(packed_gguf):
    llm = make_llm(packed_gguf, dtype="float32")
    model = model_of(llm)
    config = gguf_to_hf_config(packed_gguf)
    packed = {n: m for n, m in model.named_modules() if isinstance(m, PackedWeight)}
    layers = config.num_hidden_layers
    # every projection of every layer, the embedding, and (untied) the LM head
    assert len(packed) == 4 * layers + 1 + (0 if config.tie_word_embeddings else 1)
    for name, module in model.named_modules():
        if name.endswith(("qkv_proj", "o_proj", "gate_up_proj", "down_proj")):
            assert isinstance(module.weight, PackedWeight), name
            # float32 layers: the float-activation kernel (bf16: test_fused_stack_... below)
            assert isinstance(module.linear, KernelFloatPackedLinear) == HAVE_COMPILER, name
    if config.tie_word_embeddings:
        assert model.lm_head.weight is model.model.embed_tokens.weight
        qkv = model.model.layers[0].self_attn.qkv_proj.weight
        assert qkv.qtypes == [Q.Q4_K, Q.Q4_K, Q.Q6_K]  # q, k, v: segments of their own types
    # no float copy of any matrix: only norms (and biases) remain as dense parameters
    assert all(p.dim() == 1 for p in model.parameters())
    dense = model_of(make_llm(packed_gguf, dtype="float32", quantization="none"))
    assert not any(isinstance(m, PackedWeight) for m in dense.modules())


@pytest.mark.skipif(not HAVE_COMPILER, reason="no C++ compiler for the CPU kernels")
def test_outputs_unchanged_by_caching_chunking_preemption_and_batching(packed_gguf):
    # bf16 too: packed models ask for reproducible attention and SiLU (Reproducible hooks),
    # which bf16 dense models do not get (their prefill and decode attention round differently)
    ps = prompts()
    for dtype in ("float32", "bfloat16"):
        expected = generate(make_llm(packed_gguf, dtype=dtype, enable_prefix_caching=False), ps)
        for name, kwargs in CONFIGS.items():
            llm = make_llm(packed_gguf, dtype=dtype, **kwargs)
            assert generate(llm, ps) == expected, f"{dtype}/{name}"
            metrics = {m.name: m.value for m in llm.get_metrics()}
            if name == "preemption":
                assert metrics["impasto:num_preemptions"] > 0
        alone = [generate(make_llm(packed_gguf, dtype=dtype), [p])[0] for p in ps]
        assert alone == expected, f"{dtype}: batch composition"


@pytest.mark.skipif(not HAVE_COMPILER, reason="no C++ compiler for the CPU kernels")
def test_long_prompts_identical_in_one_pass_in_chunks_and_from_the_cache(packed_gguf):
    """Prompts longer than the attention kernel's 64-query tiles: the same logprobs, bit for
    bit, prefilled in one pass, in chunks of 7 and 50 tokens, batched, and re-run on a full
    prefix-cache hit."""
    rng = random.Random(3)
    long = [[rng.randrange(160) for _ in range(n)] for n in (150, 97)]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=3)

    def run(llm: LLM, ps: list[list[int]]) -> list[list[tuple[int, float]]]:
        outs = llm.generate([{"prompt_token_ids": p} for p in ps], params, use_tqdm=False)
        return [[(t, lp[t].logprob) for t, lp in zip(o.outputs[0].token_ids,
                                                       o.outputs[0].logprobs, strict=True)]
                for o in outs]  # fmt: skip

    for dtype in ("float32", "bfloat16"):
        one = [run(make_llm(packed_gguf, dtype=dtype, enable_chunked_prefill=False,
                            enable_prefix_caching=False, max_num_seqs=1), [p])[0]
               for p in long]  # fmt: skip
        for chunk in (7, 50):
            llm = make_llm(packed_gguf, dtype=dtype, max_num_batched_tokens=chunk)
            assert run(llm, long) == one, f"{dtype}: chunks of {chunk}"
            assert run(llm, long) == one, f"{dtype}: prefix-cache hit"


@pytest.mark.skipif(not HAVE_COMPILER, reason="no C++ compiler for the CPU kernels")
def test_fused_stack_takes_packed_weights_bit_identically(packed_gguf, monkeypatch):
    """The one-call decoder stack runs the packed matmul like the per-module path."""
    ps = prompts()
    stacked = make_llm(packed_gguf, dtype="bfloat16")  # the stack serves bf16 activations
    model = model_of(stacked).model
    assert model.fused_stack is not None
    calls = 0
    inner = model.fused_stack

    def counting(x, cos_sin):
        nonlocal calls
        out = inner(x, cos_sin)
        calls += out is not None
        return out

    model.fused_stack = counting
    got = generate(stacked, ps)
    assert calls > 0
    per_module = make_llm(packed_gguf, dtype="bfloat16")
    model_of(per_module).model.fused_stack = None
    assert generate(per_module, ps) == got


@pytest.mark.skipif(not HAVE_COMPILER, reason="no C++ compiler for the CPU kernels")
def test_speculative_decoding_is_lossless_on_packed_weights(packed_gguf):
    ps = prompts()
    expected = generate(make_llm(packed_gguf, enable_prefix_caching=False), ps)
    specs = {
        "ngram": dict(method="ngram", num_speculative_tokens=3, prompt_lookup_min=1,
                      prompt_lookup_max=3),
        "self-draft": dict(model=str(packed_gguf), num_speculative_tokens=3,
                           acceptance_backoff=False),
    }  # fmt: skip
    for mode, spec in specs.items():
        llm = make_llm(packed_gguf, speculative_config=spec, max_num_batched_tokens=7)
        assert generate(llm, ps) == expected, mode
        metrics = {m.name: m.value for m in llm.get_metrics()}
        assert metrics["impasto:spec_decode_num_draft_tokens"] > 0, mode
        if mode == "self-draft":  # the packed draft computes exactly what the target does
            assert (metrics["impasto:spec_decode_num_accepted_tokens"]
                    == metrics["impasto:spec_decode_num_draft_tokens"])  # fmt: skip


@pytest.mark.parametrize("limit", [96, 100])  # interleaved head rows; a partial group of 8
def test_draft_vocab_size_narrows_the_draft_head_only(packed_gguf, limit):
    ps = prompts()
    expected = generate(make_llm(packed_gguf, enable_prefix_caching=False), ps)
    spec = dict(model=str(packed_gguf), num_speculative_tokens=3, acceptance_backoff=False,
                draft_vocab_size=limit)  # fmt: skip
    llm = make_llm(packed_gguf, speculative_config=spec)
    assert generate(llm, ps) == expected
    target, draft = model_of(llm), llm.llm_engine.runner.proposer.model
    assert isinstance(draft.lm_head.weight, PackedWeight) and draft.lm_head.weight.rows == limit
    assert draft.model.embed_tokens.weight.rows == 160  # lookups keep the whole table
    hidden = torch.randn(5, draft.lm_head.weight.cols, generator=torch.Generator().manual_seed(0))
    full, narrow = target.compute_logits(hidden), draft.compute_logits(hidden)
    assert narrow.shape == (5, limit)
    if limit % 8 == 0:  # the same kernel on the same rows
        assert torch.equal(narrow, full[:, :limit])
    else:  # the last rows from the row layout: the same sums grouped differently
        torch.testing.assert_close(narrow, full[:, :limit], rtol=1e-5, atol=1e-5)
    m = {m.name: m.value for m in llm.get_metrics()}
    assert (
        0 < m["impasto:spec_decode_num_accepted_tokens"] < m["impasto:spec_decode_num_draft_tokens"]
    )


def test_eager_fallback_and_dequantized_load_agree_with_the_kernels(packed_gguf, monkeypatch):
    """Without the kernels the packed layers dequantize rows and matmul; with
    quantization='none' every weight is dense; float32 kernels dequantize rows exactly and keep
    the activations in float32. All three compute the same model to float32 summation order.
    The bf16 kernels round activations to 8 bits: their log-probabilities stay close."""
    ps = prompts()[:4]
    params = SamplingParams(temperature=0.0, max_tokens=1, logprobs=5)

    def first_logprobs(llm: LLM) -> list[dict[int, float]]:
        outs = llm.generate([{"prompt_token_ids": p} for p in ps], params, use_tqdm=False)
        return [{t: lp.logprob for t, lp in o.outputs[0].logprobs[0].items()} for o in outs]

    kernel = first_logprobs(make_llm(packed_gguf, dtype="float32"))
    int8 = first_logprobs(make_llm(packed_gguf, dtype="bfloat16"))
    dense = first_logprobs(make_llm(packed_gguf, dtype="float32", quantization="none"))
    monkeypatch.setenv("IMPASTO_CPU_KERNELS", "0")
    eager_llm = make_llm(packed_gguf, dtype="float32")
    assert not any(isinstance(m.linear, KERNEL_LINEARS)
                   for m in model_of(eager_llm).modules() if hasattr(m, "linear"))  # fmt: skip
    eager = first_logprobs(eager_llm)
    for k, i, d, e in zip(kernel, int8, dense, eager, strict=True):
        assert set(k) == set(d) and max(abs(k[t] - d[t]) for t in k) < 1e-4
        assert set(e) == set(d) and max(abs(e[t] - d[t]) for t in e) < 1e-5
        shared = set(i) & set(d)
        assert len(shared) >= 3
        # 8-bit activations: ~0.4 % relative error per matmul, and bf16 roundings between the
        # matmuls: up to ~0.1 nat on these peaked random models
        assert max(abs(i[t] - d[t]) for t in shared) < 0.15
    np.testing.assert_equal(len(kernel), len(ps))


def test_quantization_argument(packed_gguf, tmp_path):
    from impasto.config.engine_args import EngineArgs
    from impasto.errors import InvalidParameterError

    with pytest.raises(InvalidParameterError, match="quantization 'awq' is not supported"):
        EngineArgs(model=str(packed_gguf), quantization="awq")
    hf = build_checkpoint(tmp_path / "hf", "llama")
    with pytest.raises(InvalidParameterError, match="needs a GGUF file"):
        make_llm(hf, quantization="gguf")
    explicit = model_of(make_llm(packed_gguf, quantization="gguf"))
    assert any(isinstance(m, PackedWeight) for m in explicit.modules())
