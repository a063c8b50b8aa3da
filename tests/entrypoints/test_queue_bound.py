"""`max_waiting_requests` offline: `LLMEngine.add_request` and `LLM.generate` refuse with
`QueueFullError` (nothing enqueued, nothing left behind) past the bound; a request with n
choices takes n places; a free seat in the running batch is not a wait."""

from __future__ import annotations

import pickle

import pytest

from impasto import LLM, SamplingParams
from impasto.config.engine_args import EngineArgs
from impasto.errors import InvalidParameterError, QueueFullError

PROMPT = {"prompt_token_ids": [5, 6, 7]}


def _llm(path, **kw) -> LLM:
    return LLM(
        str(path), dtype="float32", skip_tokenizer_init=True, max_model_len=64,
        max_num_seqs=1, max_waiting_requests=1, **kw,
    )  # fmt: skip


def test_add_request_refused_past_the_bound(tiny_llama):
    engine = _llm(tiny_llama).llm_engine
    params = SamplingParams(temperature=0, max_tokens=2)
    engine.add_request("a", PROMPT, params)  # will take the one seat
    engine.add_request("b", PROMPT, params)  # the one waiting place
    with pytest.raises(QueueFullError) as e:
        engine.add_request("c", PROMPT, params)
    assert (e.value.num_requested, e.value.num_waiting, e.value.limit) == (1, 2, 1)
    assert "waiting queue is full" in str(e.value)
    engine.step()  # a runs, b waits: still full
    with pytest.raises(QueueFullError):
        engine.add_request("c", PROMPT, params)
    while engine.has_unfinished_requests():
        engine.step()
    engine.add_request("c", PROMPT, params)  # the refused id was not kept
    while engine.has_unfinished_requests():
        engine.step()


def test_n_choices_count_n(tiny_llama):
    engine = _llm(tiny_llama).llm_engine
    with pytest.raises(QueueFullError) as e:  # 3 choices: 1 seat + 1 place is not enough
        engine.add_request("x", PROMPT, SamplingParams(n=3, max_tokens=2))
    assert e.value.num_requested == 3
    assert not engine.has_unfinished_requests()
    engine.add_request("y", PROMPT, SamplingParams(n=2, max_tokens=2))  # 1 seat + 1 place
    while engine.has_unfinished_requests():
        engine.step()


def test_generate_is_all_or_nothing(tiny_llama):
    llm = _llm(tiny_llama)
    params = SamplingParams(temperature=0, max_tokens=2)
    with pytest.raises(QueueFullError):
        llm.generate([PROMPT] * 3, params, use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()  # the two admitted were withdrawn
    outs = llm.generate([PROMPT] * 2, params, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [2, 2]


def test_unbounded_by_default_and_validated(tiny_llama):
    assert EngineArgs().max_waiting_requests is None
    with pytest.raises(InvalidParameterError) as e:
        EngineArgs(max_waiting_requests=-1)
    assert e.value.param == "max_waiting_requests"
    err = pickle.loads(pickle.dumps(QueueFullError(2, 5, 5)))  # crosses processes intact
    assert (err.num_requested, err.num_waiting, err.limit) == (2, 5, 5)
