"""Log-probabilities equal transformers' own (fp32, tiny random Llama, one forward over prompt +
output): the prompt's (`prompt_logprobs`, first position None) and the sampled tokens'
(`logprobs`), values and ranks, for the chosen tokens and the top-N, with chunked prefill and
with the whole vocabulary (-1)."""

from __future__ import annotations

import pytest
import torch

from impasto import LLM, SamplingParams
from tests.entrypoints.conftest import _hf_model

ARGS = dict(dtype="float32", skip_tokenizer_init=True, num_threads=1, max_model_len=64)
PROMPT = [5, 17, 33, 2, 99, 140, 7, 7, 61, 12, 88, 3]


@pytest.mark.parametrize("chunk", [None, 4], ids=["whole", "chunked-prefill"])
@pytest.mark.parametrize("top", [3, -1])
def test_logprobs_equal_transformers(tiny_llama, chunk, top):
    extra = {} if chunk is None else dict(max_num_batched_tokens=chunk, enable_chunked_prefill=True)
    llm = LLM(str(tiny_llama), **ARGS, max_logprobs=-1, **extra)
    params = SamplingParams(temperature=0, max_tokens=6, logprobs=top, prompt_logprobs=top)
    (out,) = llm.generate([{"prompt_token_ids": PROMPT}], params, use_tqdm=False)
    completion = out.outputs[0]
    ids = PROMPT + list(completion.token_ids)
    with torch.inference_mode():
        logits = _hf_model(tiny_llama)(torch.tensor([ids])).logits[0].float()
    ref = logits.log_softmax(-1)  # [T, V]: row t predicts token t + 1

    positions = list(out.prompt_logprobs) + list(completion.logprobs)
    assert positions[0] is None and len(positions) == len(ids)
    for t in range(1, len(ids)):
        entries = positions[t]
        row = ref[t - 1]
        order = row.argsort(descending=True)
        tok = ids[t]
        assert entries[tok].logprob == pytest.approx(float(row[tok]), abs=2e-5)
        assert entries[tok].rank == int((row > row[tok]).sum()) + 1
        k = row.numel() if top == -1 else top
        for r, t_id in enumerate(order[:k].tolist(), start=1):
            assert t_id in entries, (t, r)
            assert entries[t_id].logprob == pytest.approx(float(row[t_id]), abs=2e-5)
        assert len(entries) in (k, k + 1)
