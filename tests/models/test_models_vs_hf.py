"""Token-exact greedy decoding and close logits vs transformers on tiny random checkpoints."""

from __future__ import annotations

import pytest
import torch

from impasto import kernels
from impasto.attention.registry import get_attention_backend
from impasto.loader.hf import load_hf_model
from impasto.worker.device_prep import prepare_for_device
from tests.models.checkpoints import build_checkpoint, hf_greedy, hf_model
from tests.models.harness import PagedRunner, run_greedy

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 10000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}

# Gemma 3: 8 layers, so both kinds appear (5 local, 1 global, 2 local); windows shorter than
# the longer prompts; head_dim != hidden / heads; a score scale that is not head_dim ** -0.5.
GEMMA3 = dict(
    num_hidden_layers=8,
    head_dim=32,
    sliding_window=6,
    query_pre_attn_scalar=24,
    rope_parameters={
        "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
    },
)

VARIANTS = {
    "llama-gqa2-tied": ("llama", dict(tie_word_embeddings=True)),
    "llama-mqa-untied-llama3rope": (
        "llama",
        dict(num_key_value_heads=1, tie_word_embeddings=False, rope_parameters=LLAMA3_ROPE),
    ),
    "llama-mha-linear-rope": (
        "llama",
        dict(
            num_key_value_heads=4,
            rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 500.0},
        ),
    ),
    "mistral-window": ("mistral", dict(sliding_window=7, tie_word_embeddings=False)),
    "qwen2-bias": ("qwen2", dict(tie_word_embeddings=True)),
    "qwen2-window-layers": (
        "qwen2",
        dict(use_sliding_window=True, sliding_window=6, max_window_layers=1),
    ),
    "qwen3-qknorm-headdim32": ("qwen3", dict(head_dim=32, tie_word_embeddings=False)),
    "gemma3-local-global": ("gemma3", GEMMA3),
    # transformers ignores attn_logit_softcapping for Gemma 3, so must we
    "gemma3-mqa-softcap-untied": (
        "gemma3",
        dict(
            GEMMA3,
            num_key_value_heads=1,
            layer_types=["sliding_attention", "full_attention"] * 4,
            final_logit_softcapping=3.0,
            attn_logit_softcapping=2.0,
            tie_word_embeddings=False,
        ),
    ),
}

PROMPTS = [[5, 17, 99], [1, 200, 31, 64, 8, 9, 120, 77, 3, 45, 46], [7] * 4 + list(range(30, 52))]
MAX_NEW = 8


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def checkpoint(request, tmp_path_factory):
    kind, overrides = VARIANTS[request.param]
    return build_checkpoint(tmp_path_factory.mktemp(request.param), kind, **overrides)


def test_greedy_and_prompt_logits_match_hf(checkpoint):
    model, config = load_hf_model(checkpoint, dtype=torch.float32)
    runner = PagedRunner(model, num_blocks=64, block_size=4)
    outs, prompt_logits = run_greedy(runner, PROMPTS, MAX_NEW, chunk=5)
    ref = hf_model(checkpoint)
    for prompt, out, logits in zip(PROMPTS, outs, prompt_logits, strict=True):
        assert out == hf_greedy(ref, prompt, MAX_NEW), f"prompt {prompt}"
        with torch.inference_mode():
            expect = ref(torch.tensor([prompt])).logits[0].float()
        torch.testing.assert_close(logits, expect, atol=1e-4, rtol=1e-4)


def test_outputs_are_not_degenerate(checkpoint):
    """Guard for the test itself: random weights must give varied tokens and logits."""
    outs = [hf_greedy(hf_model(checkpoint), p, MAX_NEW) for p in PROMPTS[:2]]
    assert len({t for o in outs for t in o}) >= 4


@pytest.mark.parametrize("variant", ["llama-gqa2-tied", "gemma3-local-global"])
def test_bf16_close_to_fp32(variant, tmp_path):
    kind, overrides = VARIANTS[variant]
    path = build_checkpoint(tmp_path, kind, **overrides)
    logits = {}
    for dtype in (torch.float32, torch.bfloat16):
        model, _ = load_hf_model(path, dtype=dtype)
        assert model.model.embed_tokens.weight.dtype == dtype
        runner = PagedRunner(model, dtype=dtype)
        _, (lg, *_) = run_greedy(runner, PROMPTS[1:], 2, chunk=4)
        logits[dtype] = lg
    err = (logits[torch.bfloat16] - logits[torch.float32]).abs().max()
    assert err < 0.1 * logits[torch.float32].abs().max()


def test_gemma3_bf16_device_preparation(tmp_path):
    """bf16 on CPU with device preparation (kernels for the Gemma norms, rotary and GEMMs; the
    GELU MLP stays eager): as close to fp32 as eager bf16 is. (bf16 itself is ~10% off on
    these 8 random layers, transformers' bf16 as much, so the paths are compared by that.)"""
    kind, overrides = VARIANTS["gemma3-local-global"]
    path = build_checkpoint(tmp_path, kind, **overrides)
    ref_tokens, ref_logits = run_greedy(PagedRunner(load_hf_model(path)[0]), PROMPTS, 4)
    errors = []
    for prepare in (False, True):
        model, _ = load_hf_model(path, dtype=torch.bfloat16)
        if prepare:
            prepare_for_device(model)
            if kernels.load() is not None:
                assert model.model.norm.fused_ops is not None
        assert model.model.layers[0].mlp.fused_ops is None  # GELU: never the SiLU kernel
        tokens, logits = run_greedy(PagedRunner(model, dtype=torch.bfloat16), PROMPTS, 4)
        assert tokens == ref_tokens
        errors.append([(a - b).abs().max().item() for a, b in zip(logits, ref_logits, strict=True)])
    for eager, prepared, ref in zip(*errors, ref_logits, strict=True):
        assert prepared <= 2 * eager + 0.01 * ref.abs().max().item()


@pytest.mark.parametrize("variant", ["llama-mqa-untied-llama3rope", "qwen2-window-layers"])
def test_greedy_with_embedding_bag_decode_path(variant, tmp_path, monkeypatch):
    """The 16-bit decode path (P @ V by embedding_bag), forced on in fp32: still token-exact."""
    monkeypatch.setattr(get_attention_backend(), "short_path", "bag")
    kind, overrides = VARIANTS[variant]
    path = build_checkpoint(tmp_path, kind, **overrides)
    model, _ = load_hf_model(path)
    outs, _ = run_greedy(PagedRunner(model), PROMPTS, MAX_NEW, chunk=5)
    ref = hf_model(path)
    assert outs == [hf_greedy(ref, p, MAX_NEW) for p in PROMPTS]
