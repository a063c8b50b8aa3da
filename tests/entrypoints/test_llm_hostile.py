"""The offline `LLM` under hostile prompts and parameters (hypothesis, a tiny model): a call either
generates or raises ValueError / TypeError at admission, before anything is enqueued; the engine
stays usable, and a valid request afterwards generates exactly what it did before the fuzzing.

The example count is small for the suite; IMPASTO_FUZZ_EXAMPLES raises it for a campaign.
"""

from __future__ import annotations

import math
import os
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from impasto import LLM, SamplingParams
from impasto.engine.processor import InputProcessor
from impasto.errors import InvalidParameterError

EXAMPLES = int(os.environ.get("IMPASTO_FUZZ_EXAMPLES", "500"))
MAX_MODEL_LEN = 32
VOCAB = 160  # the engine tests' tiny checkpoints
VALID = [{"prompt_token_ids": [5, 6, 7]}]


@pytest.fixture(scope="module")
def llm(tiny_llama) -> LLM:
    return LLM(
        str(tiny_llama), dtype="float32", skip_tokenizer_init=True, max_model_len=MAX_MODEL_LEN
    )


def _greedy(llm: LLM) -> list[int]:
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    (out,) = llm.generate(VALID, params, use_tqdm=False)
    return out.outputs[0].token_ids


token = st.one_of(
    st.integers(0, VOCAB - 1),
    st.integers(),
    st.sampled_from([-1, VOCAB, 2**63, 10**400, True, 1.5, 2.0, math.nan, "7", None]),
    st.builds(np.int64, st.integers(0, VOCAB - 1)),
)
token_lists = st.lists(token, max_size=40)
valid_ids = st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=20)
prompts = st.one_of(
    valid_ids,
    st.builds(lambda ids: {"prompt_token_ids": ids}, valid_ids),
    token_lists,
    st.lists(token_lists, max_size=3),
    st.builds(lambda ids: {"prompt_token_ids": ids}, token_lists),
    st.builds(
        lambda ids, text: {"prompt_token_ids": ids, "prompt": text}, token_lists, st.integers()
    ),
    st.sampled_from(
        [
            "text, but there is no tokenizer",
            "",
            None,
            5,
            {},
            {"prompt": 5},
            {"prompt_token_ids": "abc"},
            {"prompt_token_ids": 5},
            {"multi_modal_data": {"image": 1}, "prompt_token_ids": [1]},
            [[]],
            [{}],
            np.arange(3),
            b"bytes",
        ]
    ),
)
hostile_values = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-3, 40),
    st.sampled_from([2**63, -(2**63) - 1, 10**400, math.nan, math.inf, -math.inf, 1e308]),
    st.floats(-3, 3),
    st.text(max_size=3),
    st.lists(st.integers(-2, 200), max_size=3),
    st.dictionaries(st.integers(-2, 200), st.floats(allow_nan=True), max_size=2),
)
param_kwargs = st.dictionaries(
    st.sampled_from(SamplingParams.user_fields()), hostile_values, max_size=4
)


def _params(kwargs: dict[str, Any]) -> Any:
    """SamplingParams when the kwargs build one (with a small max_tokens, to keep the run short),
    else the kwargs dict itself: a wrong type handed to generate()."""
    try:
        params = SamplingParams(**kwargs)
    except (ValueError, TypeError):
        return kwargs
    if params.max_tokens is None or params.max_tokens > 4:
        params.max_tokens = 4
    if params.min_tokens > params.max_tokens:
        params.min_tokens = 0
    params.n = min(params.n, 4)
    return params


def test_hostile_generate_calls(llm):
    engine = llm.llm_engine
    before = _greedy(llm)

    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(
        prompt=prompts,
        kwargs=st.one_of(param_kwargs, st.none()),
        priority=st.one_of(st.none(), st.lists(st.sampled_from([0, 1, -1, 2**70, 1.5, "a"]))),
    )
    def call(prompt: Any, kwargs: dict[str, Any] | None, priority: Any) -> None:
        params = None if kwargs is None else _params(kwargs)
        try:
            outputs = llm.generate(prompt, params, use_tqdm=False, priority=priority)
        except (ValueError, TypeError, IndexError) as e:
            # IndexError: a `priority` list shorter than the prompts (the caller's list).
            assert not isinstance(e, IndexError) or priority is not None
            assert not engine.has_unfinished_requests()  # refused before anything was enqueued
            return
        assert all(o.finished for o in outputs)
        assert not engine.has_unfinished_requests()

    call()
    assert _greedy(llm) == before


class _Tokenizer:
    """The least a tokenizer offers the admission path: a vocabulary and encoding."""

    def get_vocab(self) -> dict[str, int]:
        return {"a": 0, "bb": 1, "<0x0A>": 2}

    def __call__(self, text: str, **_: Any):
        raise AssertionError("the text should have been refused before tokenizing it")


def test_text_refused_before_tokenizing(llm):
    processor = InputProcessor(llm.llm_engine.config.model, _Tokenizer())
    assert processor.max_token_chars == 6
    with pytest.raises(InvalidParameterError) as info:
        processor.tokenize("ok \ud800")
    assert info.value.param == "prompt"
    with pytest.raises(InvalidParameterError, match="maximum context length") as info:
        processor.tokenize("x" * (MAX_MODEL_LEN * 6 + 1))
    assert info.value.param == "input_tokens"


@pytest.mark.parametrize(
    "prompt",
    [
        [1, 2.0],
        [1, True],
        {"prompt_token_ids": ["1"]},
        {"prompt_token_ids": [1], "prompt": 7},
        {"prompt_token_ids": 3},
    ],
)
def test_token_ids_must_be_integers(llm, prompt):
    """Found by fuzzing: a dict prompt's token ids went unchecked (floats and bools were taken
    as token ids, a string was a bare TypeError naming no parameter)."""
    with pytest.raises(InvalidParameterError) as info:
        llm.generate(prompt, SamplingParams(max_tokens=1), use_tqdm=False)
    assert info.value.param == "prompt"
    assert not llm.llm_engine.has_unfinished_requests()
