"""SamplingParams validation: every bad value raises ValueError naming the parameter."""

from __future__ import annotations

from typing import Any

import pytest

from impasto.sampling_params import SamplingParams, SamplingType

BAD: list[tuple[str, dict[str, Any]]] = [
    ("n", {"n": 0}),
    ("presence_penalty", {"presence_penalty": 2.5}),
    ("frequency_penalty", {"frequency_penalty": -3.0}),
    ("repetition_penalty", {"repetition_penalty": 0.0}),
    ("temperature", {"temperature": -0.1}),
    ("temperature", {"temperature": float("nan")}),
    ("top_p", {"top_p": 0.0}),
    ("top_p", {"top_p": 1.5}),
    ("top_k", {"top_k": -2}),
    ("top_k", {"top_k": 2.5}),
    ("top_k", {"top_k": -1.0}),
    ("min_p", {"min_p": 1.5}),
    ("seed", {"seed": 2**64}),
    ("seed", {"seed": "7"}),
    ("max_tokens", {"max_tokens": 0}),
    ("min_tokens", {"min_tokens": -1}),
    ("min_tokens", {"min_tokens": 5, "max_tokens": 4}),
    ("logprobs", {"logprobs": -2}),
    ("prompt_logprobs", {"prompt_logprobs": 1.5}),
    ("stop", {"stop": [""]}),
    ("stop", {"stop": 5}),
    ("stop", {"stop": ["x"], "detokenize": False}),
    ("stop_token_ids", {"stop_token_ids": [-1]}),
    ("stop_token_ids", {"stop_token_ids": 3}),
    ("logit_bias", {"logit_bias": {1: 200.0}}),
    ("logit_bias", {"logit_bias": {"abc": 1.0}}),
    ("logit_bias", {"logit_bias": {-4: 1.0}}),
    ("logit_bias", {"logit_bias": [1, 2]}),
    ("ignore_eos", {"ignore_eos": "yes"}),
    # the caps of impasto.limits
    ("n", {"n": 129}),
    ("top_k", {"top_k": 2**63}),
    ("min_tokens", {"min_tokens": 10**30}),
    ("max_tokens", {"max_tokens": 2**63}),
    ("logprobs", {"logprobs": -(2**63) - 1}),
    ("stop", {"stop": [f"s{i}" for i in range(65)]}),
    ("stop", {"stop": ["x" * 1025]}),
    ("stop", {"stop": ["\ud800"]}),
    ("stop_token_ids", {"stop_token_ids": list(range(1025))}),
    ("stop_token_ids", {"stop_token_ids": [2**63]}),
    ("allowed_token_ids", {"allowed_token_ids": list(range(16385))}),
    ("bad_words", {"bad_words": [f"w{i}" for i in range(129)]}),
    ("bad_words", {"bad_words": ["y" * 1025]}),
    ("logit_bias", {"logit_bias": {i: 1.0 for i in range(1025)}}),
    ("logit_bias", {"logit_bias": {"\u0663": 1.0}}),
    ("logit_bias", {"logit_bias": {1: float("nan")}}),
    ("skip_special_tokens", {"skip_special_tokens": 0}),
    ("include_stop_str_in_output", {"include_stop_str_in_output": "no"}),
]


def test_caps_are_inclusive() -> None:
    """Each cap is the largest value accepted."""
    from impasto import limits

    SamplingParams(
        n=limits.MAX_N,
        stop=[f"s{i}" + "x" * 1000 for i in range(limits.MAX_STOP_STRINGS)],
        stop_token_ids=list(range(limits.MAX_STOP_TOKEN_IDS)),
        allowed_token_ids=list(range(limits.MAX_ALLOWED_TOKEN_IDS)),
        bad_words=[f"w{i}" for i in range(limits.MAX_BAD_WORDS)],
        logit_bias={i: 100.0 for i in range(limits.MAX_LOGIT_BIAS_ENTRIES)},
        seed=2**64 - 1,
        top_k=2**63 - 1,
        max_tokens=2**63 - 1,
    )
    SamplingParams(stop=["z" * limits.MAX_TEXT_PARAM_CHARS], seed=-(2**63))


@pytest.mark.parametrize(("param", "kwargs"), BAD)
def test_validation_names_the_parameter(param: str, kwargs: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match=rf"^{param}\b") as info:
        SamplingParams(**kwargs)
    assert getattr(info.value, "param", None) == param


def test_normalisation_and_types() -> None:
    p = SamplingParams(temperature=0.0, top_k=5, top_p=0.5, min_p=0.1, seed=3)
    assert p.sampling_type == SamplingType.GREEDY and p.is_greedy
    assert (p.top_k, p.top_p, p.min_p) == (0, 1.0, 0.0)
    assert SamplingParams(seed=3).sampling_type == SamplingType.RANDOM_SEED
    assert SamplingParams(top_k=-1).top_k == 0
    assert SamplingParams(stop="a").stop == ["a"]
    assert SamplingParams(logit_bias={"12": 3.0}).logit_bias == {12: 3.0}
    q = SamplingParams(stop_token_ids=[5], ignore_eos=False)
    q.update_from_tokenizer(None, 2, {7})
    assert q.all_stop_token_ids == {5, 7} and q.eos_token_id == 2
    assert SamplingParams(repetition_penalty=1.1).has_penalties
