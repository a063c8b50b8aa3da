"""Admission rules taken from vLLM, offline as over HTTP (one admission path):
`truncate_prompt_tokens` keeps the last k prompt tokens (-1: as many as the context allows);
a non-zero `priority` needs priority scheduling (it would be ignored under FCFS)."""

from __future__ import annotations

import pytest

from impasto import LLM, SamplingParams


def test_truncation_equals_the_tail_prompt(tiny_llama):
    llm = LLM(str(tiny_llama), dtype="float32", skip_tokenizer_init=True, max_model_len=32)
    prompt = list(range(3, 43))  # 40 tokens: longer than the context
    greedy = dict(temperature=0.0, max_tokens=4, ignore_eos=True)
    cut = llm.generate(
        [{"prompt_token_ids": prompt}], SamplingParams(truncate_prompt_tokens=7, **greedy)
    )[0]
    tail = llm.generate([{"prompt_token_ids": prompt[-7:]}], SamplingParams(**greedy))[0]
    assert cut.prompt_token_ids == prompt[-7:]
    assert cut.outputs[0].token_ids == tail.outputs[0].token_ids
    fit = llm.generate(
        [{"prompt_token_ids": prompt}], SamplingParams(truncate_prompt_tokens=-1, max_tokens=1)
    )[0]
    assert fit.prompt_token_ids == prompt[-31:]  # room for one generated token
    with pytest.raises(ValueError, match="input tokens"):  # untruncated: too long
        llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=1))
    for bad in (0, -2, 1.5, True):
        with pytest.raises(ValueError, match="truncate_prompt_tokens"):
            SamplingParams(truncate_prompt_tokens=bad)


def test_priority_needs_priority_scheduling(tiny_llama):
    """vLLM's rule: a priority under FCFS would be ignored, so it is refused."""
    fcfs = LLM(str(tiny_llama), dtype="float32", skip_tokenizer_init=True, max_model_len=32)
    params = SamplingParams(max_tokens=1)
    prompts = [{"prompt_token_ids": [3, 4, 5]}] * 2
    with pytest.raises(ValueError, match="priority scheduling is not enabled"):
        fcfs.generate(prompts, params, priority=[0, 1])
    assert not fcfs.llm_engine.has_unfinished_requests()
    assert len(fcfs.generate(prompts, params, priority=[0, 0])) == 2
    prio = LLM(
        str(tiny_llama),
        dtype="float32",
        skip_tokenizer_init=True,
        max_model_len=32,
        scheduling_policy="priority",
    )
    assert len(prio.generate(prompts, params, priority=[0, 1])) == 2
