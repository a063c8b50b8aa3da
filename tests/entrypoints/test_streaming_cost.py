"""The engine's outputs are deltas: a streamed request of N tokens moves N tokens in total
(counted, not timed), and the offline API's accumulated result equals the deltas' sum."""

from __future__ import annotations

from impasto import LLM, SamplingParams


def test_a_streamed_request_costs_o_n(tiny_llama):
    llm = LLM(str(tiny_llama), dtype="float32", skip_tokenizer_init=True, max_model_len=256)
    engine = llm.llm_engine
    n = 120
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=1)
    engine.add_request("r", {"prompt_token_ids": [5, 6, 7]}, params)
    moved, steps, tokens = 0, 0, []
    while engine.has_unfinished_requests():
        for delta in engine.step():
            (c,) = delta.outputs
            moved += len(c.token_ids) + len(c.logprobs or [])
            assert len(c.token_ids) <= 1  # one new token per decode step, never the history
            tokens += c.token_ids
        steps += 1
    assert moved == 2 * n and steps <= n + 1
    offline = llm.generate([{"prompt_token_ids": [5, 6, 7]}], params, use_tqdm=False)[0]
    assert offline.outputs[0].token_ids == tokens and len(offline.outputs[0].logprobs) == n
