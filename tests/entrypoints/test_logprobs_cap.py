"""`logprobs=-1` (the whole vocabulary) follows vLLM: refused above `max_logprobs`, and with the
cap lifted every position carries every token."""

from __future__ import annotations

import pytest

from impasto import LLM, SamplingParams
from impasto.errors import InvalidParameterError


def test_whole_vocabulary_logprobs(tiny_llama):
    prompt = [{"prompt_token_ids": [5, 6, 7]}]
    params = SamplingParams(temperature=0, max_tokens=3, logprobs=-1)
    capped = LLM(str(tiny_llama), dtype="float32", skip_tokenizer_init=True, max_model_len=64)
    with pytest.raises(InvalidParameterError, match="greater than max allowed: 20") as e:
        capped.generate(prompt, params, use_tqdm=False)
    assert e.value.param == "logprobs"
    llm = LLM(
        str(tiny_llama), dtype="float32", skip_tokenizer_init=True, max_model_len=64,
        max_logprobs=-1,
    )  # fmt: skip
    (out,) = llm.generate(prompt, params, use_tqdm=False)
    vocab = llm.llm_engine.vocab_size
    assert [len(p) for p in out.outputs[0].logprobs] == [vocab] * 3
