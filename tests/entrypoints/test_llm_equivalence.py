"""Token-exact greedy equality with transformers (fp32), and invariance of the outputs under
prefix caching, chunked prefill, preemption and batch composition."""

from __future__ import annotations

import random

import pytest

from impasto import LLM, SamplingParams

from .conftest import build_checkpoint, hf_greedy

MAX_TOKENS = 12
VARIANTS = {
    "llama-gqa-tied": ("llama", dict(tie_word_embeddings=True)),
    "llama-mha-untied-rope3": (
        "llama",
        dict(
            num_key_value_heads=4,
            tie_word_embeddings=False,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        ),
    ),
    "qwen2": ("qwen2", dict(tie_word_embeddings=False)),
    "qwen3-mqa": ("qwen3", dict(num_key_value_heads=1, tie_word_embeddings=True)),
}
CONFIGS = {
    "plain": dict(enable_prefix_caching=False),
    "prefix-cache": dict(enable_prefix_caching=True),
    "small-chunks": dict(enable_prefix_caching=True, max_num_batched_tokens=7),
    "preemption": dict(enable_prefix_caching=True, num_gpu_blocks_override=18, max_model_len=64),
    "no-chunking": dict(enable_prefix_caching=False, enable_chunked_prefill=False),
}


def _prompts(vocab: int) -> list[list[int]]:
    rng = random.Random(0)
    shared = [rng.randrange(vocab) for _ in range(13)]
    prompts = [shared + [rng.randrange(vocab) for _ in range(n)] for n in (0, 3, 20, 31)]
    prompts += [[rng.randrange(vocab) for _ in range(n)] for n in (1, 5, 17)]
    prompts.append(list(prompts[2]))  # an exact duplicate: a full prefix hit
    return prompts


@pytest.fixture(scope="module", params=list(VARIANTS))
def checkpoint(request, tmp_path_factory):
    kind, overrides = VARIANTS[request.param]
    return build_checkpoint(tmp_path_factory.mktemp(request.param), kind, **overrides)


def _run(path, prompts, **kwargs) -> tuple[list[list[int]], dict[str, float]]:
    args = dict(dtype="float32", skip_tokenizer_init=True, block_size=4, max_num_seqs=8)
    args.update(kwargs)
    llm = LLM(str(path), **args)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    metrics = {m.name: m.value for m in llm.get_metrics()}
    return [o.outputs[0].token_ids for o in outs], metrics


def test_greedy_matches_transformers_under_every_config(checkpoint):
    prompts = _prompts(160)
    expected = [hf_greedy(checkpoint, p, MAX_TOKENS) for p in prompts]
    for name, kwargs in CONFIGS.items():
        got, metrics = _run(checkpoint, prompts, **kwargs)
        for i, (g, e) in enumerate(zip(got, expected, strict=True)):
            assert g == e, f"{name}: prompt {i} (len {len(prompts[i])}) diverged"
        if name == "preemption":
            assert metrics["impasto:num_preemptions"] > 0
        if name == "prefix-cache":
            assert metrics["impasto:prefix_cache_hits"] > 0


def test_batch_composition_does_not_change_outputs(tiny_llama):
    prompts = _prompts(160)
    together, _ = _run(tiny_llama, prompts)
    alone = [_run(tiny_llama, [p])[0][0] for p in prompts[:3]]
    assert together[:3] == alone
