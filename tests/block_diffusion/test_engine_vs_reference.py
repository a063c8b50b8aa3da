"""The engine decodes masked block-diffusion models exactly as the plain reference decoder does
(full-sequence forwards under the explicit block-causal mask, one request at a time): every
unmasking rule, greedy and seeded sampling, batched, with prefix caching, chunked prefill and
preemption; and the reference agrees with the upstream-style KV-cached loop."""

from __future__ import annotations

import pytest

from impasto.config.block_diffusion import UnmaskingParams
from impasto.sampling_params import SamplingParams
from impasto.testing.block_diffusion import cached_generate, reference_generate

from .conftest import KINDS, make_llm, reference_model

# Lengths around the block boundaries and 1 mod the 16-token KV page (resume needs 1 token).
PROMPTS = [[5 + i for i in range(n)] for n in (1, 3, 4, 9, 17, 33)]
MAX_TOKENS = 11  # not a multiple of any block size: the last block is truncated
ALGORITHMS = [
    dict(algorithm="low_confidence", threshold=0.6),
    dict(algorithm="top_k", k_per_step=2),
    dict(algorithm="entropy_bounded", entropy_bound=1.0),
    dict(algorithm="random", k_per_step=2),
]
SAMPLED = dict(temperature=0.8, top_k=40, top_p=0.9)


def expected(path, block, shift, prompt, algo, sampling, seed):
    return reference_generate(
        reference_model(path), prompt, block_size=block, token_shift=shift,
        max_tokens=MAX_TOKENS, params=UnmaskingParams(**algo), seed=seed,
        **sampling,
    )  # fmt: skip


def engine_outputs(llm, algo, sampling, seeds):
    params = [
        SamplingParams(
            max_tokens=MAX_TOKENS, ignore_eos=True, seed=s, extra_args=dict(algo), **sampling
        )
        for s in seeds
    ]
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.mark.parametrize("kind", KINDS, ids=[f"{f}-B{b}" for f, b in KINDS])
@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_every_rule_matches_the_reference_batched(checkpoints, kind, sampled):
    flavour, block = kind
    path, shift = checkpoints[kind], flavour == "fast_dllm"
    sampling = SAMPLED if sampled else dict(temperature=0.0)
    seeds = list(range(len(PROMPTS)))
    llm = make_llm(path)
    for algo in ALGORITHMS:
        got = engine_outputs(llm, algo, sampling, seeds)
        want = [
            expected(path, block, shift, p, algo, sampling, s)
            for p, s in zip(PROMPTS, seeds, strict=True)
        ]
        assert got == want, algo


@pytest.mark.parametrize(
    "engine_args",
    [
        dict(max_num_seqs=1),  # each request alone
        dict(enable_prefix_caching=True),
        dict(max_num_batched_tokens=16),  # chunked prefill, one block pair per step
        dict(num_gpu_blocks_override=9, max_num_seqs=6, enable_prefix_caching=True),  # preempts
    ],
    ids=["alone", "prefix-caching", "chunked-prefill", "preemption"],
)
@pytest.mark.parametrize("kind", [("sdar", 4), ("fast_dllm", 8)], ids=["sdar-B4", "fast-B8"])
def test_features_that_must_not_change_outputs(checkpoints, kind, engine_args):
    flavour, block = kind
    path, shift = checkpoints[kind], flavour == "fast_dllm"
    algo = dict(algorithm="low_confidence", threshold=0.6)
    seeds = list(range(len(PROMPTS)))
    want = [
        expected(path, block, shift, p, algo, SAMPLED, s)
        for p, s in zip(PROMPTS, seeds, strict=True)
    ]
    llm = make_llm(path, max_model_len=128, **engine_args)
    first = engine_outputs(llm, algo, SAMPLED, seeds)
    again = engine_outputs(llm, algo, SAMPLED, seeds)  # warm prefix cache, if on
    assert first == want and again == want
    metrics = {m.name: m.value for m in llm.get_metrics()}
    if "num_gpu_blocks_override" in engine_args:
        assert metrics["impasto:num_preemptions"] > 0
    if engine_args.get("enable_prefix_caching"):
        assert metrics["impasto:prefix_cache_hits"] > 0


@pytest.mark.parametrize("kind", [("sdar", 4), ("fast_dllm", 4)], ids=["sdar", "fast"])
def test_reference_equals_the_upstream_style_cached_loop(checkpoints, kind):
    flavour, block = kind
    path, shift = checkpoints[kind], flavour == "fast_dllm"
    model = reference_model(path)
    for prompt in PROMPTS:
        for algo in ALGORITHMS:
            args = dict(block_size=block, token_shift=shift, max_tokens=MAX_TOKENS,
                        params=UnmaskingParams(**algo), seed=1, **SAMPLED)  # fmt: skip
            assert cached_generate(model, prompt, **args) == reference_generate(
                model, prompt, **args
            )


def test_eos_inside_a_block_truncates_and_stop_strings_free_nothing(checkpoints):
    """EOS committed inside a block ends the output right after it (the block's other tokens
    are dropped); min_tokens defers it."""
    path = checkpoints[("sdar", 8)]
    ref = [expected(path, 8, False, p, {}, dict(temperature=0.0), 0) for p in PROMPTS]
    # Declare each request's third output token its stop token: output = first 3 tokens.
    llm = make_llm(path)
    params = [
        SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, stop_token_ids=[r[2]]) for r in ref
    ]
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    for o, r in zip(outs, ref, strict=True):
        toks = list(o.outputs[0].token_ids)
        assert toks == r[: r.index(r[2]) + 1]
        assert o.outputs[0].finish_reason == "stop"


def test_min_tokens_defers_a_stop_token_committed_early(checkpoints):
    """A stop token committed before min_tokens does not end the output: the next occurrence
    at or after min_tokens does (or max_tokens)."""
    path = checkpoints[("sdar", 4)]
    ref = [expected(path, 4, False, p, {}, dict(temperature=0.0), 0) for p in PROMPTS]
    llm = make_llm(path)
    params = [
        SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, stop_token_ids=[r[0]], min_tokens=3)
        for r in ref
    ]
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    for o, r in zip(outs, ref, strict=True):
        later = [i for i, t in enumerate(r) if t == r[0] and i >= 2]  # output index >= 3 - 1
        want = r[: later[0] + 1] if later else r
        assert list(o.outputs[0].token_ids) == want
