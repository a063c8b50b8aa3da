"""Greedy outputs are token-identical with and without speculation (n-gram, a tiny random draft,
the target as its own draft), under prefix caching, chunked prefill, forced preemption and
uniform padding, on tiny random Llama / Qwen2 checkpoints (fp32)."""

from __future__ import annotations

import random

import pytest

from impasto import SamplingParams

from .conftest import generate, make_llm, metrics

MAX_TOKENS = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
CONFIGS = {
    "plain": dict(enable_prefix_caching=False),
    "prefix-cache+small-chunks": dict(enable_prefix_caching=True, max_num_batched_tokens=7),
    "preemption": dict(enable_prefix_caching=True, num_gpu_blocks_override=18, max_model_len=64),
    "no-chunking": dict(enable_prefix_caching=False, enable_chunked_prefill=False),
}


def prompts(vocab: int = 160) -> list[list[int]]:
    rng = random.Random(1)
    motif = [rng.randrange(vocab) for _ in range(6)]
    shared = [rng.randrange(vocab) for _ in range(13)]  # 13 % block_size 4 == 1
    out = [motif * 5, motif * 2 + [rng.randrange(vocab) for _ in range(9)]]
    out += [shared, shared + [rng.randrange(vocab) for _ in range(20)], list(shared)]
    out += [[rng.randrange(vocab) for _ in range(n)] for n in (1, 5, 17)]
    return out


def spec_modes(draft, target) -> dict[str, dict]:
    return {
        "ngram": dict(
            method="ngram", num_speculative_tokens=3, prompt_lookup_min=1, prompt_lookup_max=3
        ),
        "draft": dict(method="draft_model", model=str(draft), num_speculative_tokens=3),
        "draft-vocab": dict(model=str(draft), num_speculative_tokens=3, draft_vocab_size=100),
        "self-draft": dict(model=str(target), num_speculative_tokens=4, acceptance_backoff=False),
    }


@pytest.mark.parametrize("model_name", ["tiny_llama", "tiny_qwen2"])
def test_greedy_identical_with_speculation(model_name, request, tiny_draft):
    target = request.getfixturevalue(model_name)
    ps = prompts()
    expected = generate(make_llm(target, enable_prefix_caching=False), ps, GREEDY)
    for mode, spec in spec_modes(tiny_draft, target).items():
        for name, kwargs in CONFIGS.items():
            llm = make_llm(target, speculative_config=spec, **kwargs)
            got = generate(llm, ps, GREEDY)
            for i, (g, e) in enumerate(zip(got, expected, strict=True)):
                assert g == e, f"{mode}/{name}: prompt {i} (len {len(ps[i])}) diverged"
            m = metrics(llm)
            drafted = m["impasto:spec_decode_num_draft_tokens"]
            accepted = m["impasto:spec_decode_num_accepted_tokens"]
            assert drafted > 0, f"{mode}/{name}: nothing was drafted"
            if mode == "self-draft":  # the draft is the target: every draft is its argmax
                assert accepted == drafted, f"{name}: {accepted}/{drafted} accepted"
            if name == "preemption":
                assert m["impasto:num_preemptions"] > 0
            llm.llm_engine.scheduler.kv_cache_manager.check_integrity()


def test_uniform_padding_identical_and_reaches_the_runner(tiny_llama):
    """Placeholders (-1) reach the runner, are clamped and always rejected: same tokens."""
    ps = prompts()
    ps = [ps[2]] * 4 + ps  # duplicates of a 13-token prompt: 1-token admissions after a hit
    params = [
        SamplingParams(temperature=0.0, max_tokens=4 + 3 * i, ignore_eos=True)
        for i in range(len(ps))
    ]
    expected = generate(make_llm(tiny_llama, max_num_seqs=3), ps, params)
    for padding in (False, True):
        spec = dict(method="ngram", num_speculative_tokens=3, prompt_lookup_min=1)
        spec["uniform_spec_decode_padding"] = padding
        llm = make_llm(tiny_llama, max_num_seqs=3, speculative_config=spec)
        runner = llm.llm_engine.runner
        seen: list[int] = []
        execute = runner.execute_model

        def spy(so, execute=execute, seen=seen):
            seen.extend(t for d in so.scheduled_spec_decode_tokens.values() for t in d if t < 0)
            return execute(so)

        runner.execute_model = spy
        assert generate(llm, ps, params) == expected, f"padding={padding}"
        assert bool(seen) == padding
