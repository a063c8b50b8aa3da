"""SmolLM2-135M (the default model, fp32): greedy outputs identical with speculation, n-gram
and the model as its own draft, with prefix caching, chunked prefill and preemption."""

from __future__ import annotations

import pytest

from impasto import LLM, SamplingParams
from impasto.loader.packaged_models import ensure_default_model

from .conftest import metrics

pytestmark = pytest.mark.slow

PASSAGE = (
    "Shall I compare thee to a summer's day?\nThou art more lovely and more temperate:\n"
    "Rough winds do shake the darling buds of May,\nAnd summer's lease hath all too short a date"
)
PROMPTS = ["Repeat this passage exactly:\n\n" + PASSAGE + "\n\n" + PASSAGE[:40], "1, 2, 3, 4,"]
PARAMS = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
ARGS = dict(dtype="float32", max_model_len=112, block_size=16, num_threads=1, max_num_seqs=4)


@pytest.fixture(scope="module")
def gguf():
    return str(ensure_default_model())


def _run(gguf: str, **kwargs) -> tuple[list[list[int]], dict[str, float]]:
    llm = LLM(gguf, **{**ARGS, **kwargs})
    outs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs], metrics(llm)


def test_default_model_greedy_identical(gguf):
    expected, _ = _run(gguf, enable_prefix_caching=False)
    mixed = dict(enable_prefix_caching=True, max_num_batched_tokens=48, num_gpu_blocks_override=8)
    ngram = dict(method="ngram", num_speculative_tokens=4, prompt_lookup_min=2, prompt_lookup_max=4)
    got, m = _run(gguf, speculative_config=ngram, **mixed)
    assert got == expected
    assert m["impasto:spec_decode_num_accepted_tokens"] > 0
    assert m["impasto:num_preemptions"] > 0
    self_draft = dict(model=gguf, num_speculative_tokens=3, acceptance_backoff=False)
    got, m = _run(gguf, speculative_config=self_draft, enable_prefix_caching=True)
    assert got == expected
    drafted = m["impasto:spec_decode_num_draft_tokens"]
    assert drafted > 0 and m["impasto:spec_decode_num_accepted_tokens"] == drafted


def test_stop_string_inside_accepted_drafts_trims_tokens(gguf):
    """A stop string completed by an accepted draft ends the output at that token: token ids,
    logprobs and text equal those of a run without speculation."""
    (ref,) = LLM(gguf, **ARGS).generate(PROMPTS[:1], PARAMS, use_tqdm=False)
    text = ref.outputs[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 6]
    params = SamplingParams(
        temperature=0.0, max_tokens=20, ignore_eos=True, stop=[stop], logprobs=0
    )
    ngram = dict(method="ngram", num_speculative_tokens=4, prompt_lookup_min=2, prompt_lookup_max=4)
    outs = []
    for spec in (None, ngram):
        llm = LLM(gguf, **ARGS, speculative_config=spec)
        (out,) = llm.generate(PROMPTS[:1], params, use_tqdm=False)
        outs.append(out.outputs[0])
    plain, spec_out = outs
    assert plain.finish_reason == spec_out.finish_reason == "stop"
    assert spec_out.text == plain.text == text[: text.index(stop)]
    assert list(spec_out.token_ids) == list(plain.token_ids)
    assert len(spec_out.logprobs) == len(spec_out.token_ids)
    assert len(plain.token_ids) < 20  # the stop really cut the output short
