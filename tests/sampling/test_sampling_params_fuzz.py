"""SamplingParams under hostile values (hypothesis): any keyword arguments over the real field
names either build a SamplingParams that honours every cap of `impasto.limits` and crosses the
process boundary intact, or raise ValueError / TypeError, nothing else; `from_fields` (the HTTP
path) raises only `InvalidParameterError` naming a real field.

The example count is small for the suite; IMPASTO_FUZZ_EXAMPLES raises it for a campaign.
"""

from __future__ import annotations

import math
import os
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from impasto import limits
from impasto.errors import InvalidParameterError
from impasto.sampling_params import SamplingParams

FIELDS = SamplingParams.user_fields()
EXAMPLES = int(os.environ.get("IMPASTO_FUZZ_EXAMPLES", "300"))

_HUGE_INTS = [2**63 - 1, 2**63, 2**64, -(2**63) - 1, 10**400, -(10**400)]
_ODD_FLOATS = [math.nan, math.inf, -math.inf, 1e308, -1e308, 5e-324, -0.0]
_SURROGATES = st.characters(categories=["Cs"])

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-5, max_value=300),
    st.integers(),
    st.sampled_from(_HUGE_INTS),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from(_ODD_FLOATS),
    st.text(max_size=8),
    st.text(alphabet=_SURROGATES, min_size=1, max_size=2),
    st.sampled_from(["", " ", "\x00", "1", "-1", "12", "\u0663", "9" * 30]),
)
hostile = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.tuples(inner),
        st.frozensets(st.integers(-3, 10), max_size=3),
        st.dictionaries(st.one_of(st.integers(-3, 10), st.text(max_size=4)), inner, max_size=3),
    ),
    max_leaves=8,
)
# Large containers, to reach the size caps.
oversized = st.one_of(
    st.builds(lambda n: list(range(n)), st.sampled_from([0, 1, 1025, 16385])),
    st.builds(lambda n: [f"w{i}" for i in range(n)], st.sampled_from([65, 129])),
    st.builds(lambda n: {str(i): 1.0 for i in range(n)}, st.sampled_from([1024, 1025])),
    st.builds(lambda n: ["x" * n], st.sampled_from([1024, 1025])),
)
kwargs_strategy = st.dictionaries(
    st.sampled_from(FIELDS), st.one_of(hostile, oversized), max_size=6
)


def _check_caps(p: SamplingParams) -> None:
    assert 1 <= p.n <= limits.MAX_N
    assert isinstance(p.stop, list) and len(p.stop) <= limits.MAX_STOP_STRINGS
    assert all(0 < len(s) <= limits.MAX_TEXT_PARAM_CHARS for s in p.stop)
    assert len(p.stop_token_ids or []) <= limits.MAX_STOP_TOKEN_IDS
    assert len(p.allowed_token_ids or []) <= limits.MAX_ALLOWED_TOKEN_IDS
    assert len(p.bad_words or []) <= limits.MAX_BAD_WORDS
    bias = p.logit_bias_ids or {}
    assert len(bias) <= limits.MAX_LOGIT_BIAS_ENTRIES
    assert all(type(k) is int and k >= 0 for k in bias)
    assert all(limits.LOGIT_BIAS_MIN <= v <= limits.LOGIT_BIAS_MAX for v in bias.values())
    for name in ("temperature", "top_p", "min_p", "presence_penalty", "repetition_penalty"):
        assert math.isfinite(getattr(p, name))
    for name in ("top_k", "min_tokens", "max_tokens", "logprobs", "prompt_logprobs"):
        value = getattr(p, name)
        assert value is None or limits.INT64_MIN <= value <= limits.INT64_MAX


@settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(kwargs=kwargs_strategy)
def test_constructor_accepts_or_raises_value_or_type_error(kwargs: dict[str, Any]) -> None:
    try:
        p = SamplingParams(**kwargs)
    except (ValueError, TypeError):
        return
    _check_caps(p)
    # What was accepted crosses the API / engine process boundary and validates again there.
    again = msgspec.msgpack.decode(msgspec.msgpack.encode(p), type=SamplingParams)
    assert msgspec.structs.asdict(again) == msgspec.structs.asdict(p)


json_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.sampled_from(_HUGE_INTS),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=8),
    st.text(alphabet=_SURROGATES, min_size=1, max_size=2),
)
json_values = st.recursive(
    json_scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=4), inner, max_size=3)
    ),
    max_leaves=8,
)


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(values=st.dictionaries(st.sampled_from(FIELDS), json_values, max_size=5))
def test_from_fields_raises_only_named_errors(values: dict[str, Any]) -> None:
    """The HTTP path: JSON-shaped values either build or raise InvalidParameterError whose
    `param` is one of the fields given (what the 400's `param` reports)."""
    try:
        p = SamplingParams.from_fields(values)
    except InvalidParameterError as e:
        assert e.param in values, (e.param, e.message)
        assert len(e.message) < 2000
        return
    _check_caps(p)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"n": 10**400},
        {"top_k": 2**63},
        {"max_tokens": 10**400},
        {"stop_token_ids": [2**64]},
        {"logit_bias": {"9" * 30: 1.0}},
        {"logit_bias": {"\u0663": 1.0}},  # a digit, but not an ASCII one
        {"stop": ["\ud800"]},
        {"bad_words": ["ok", "\udfff"]},
        {"stop": [["x" * 10**6]]},
    ],
)
def test_regressions_found_by_fuzzing(kwargs: dict[str, Any]) -> None:
    name = next(iter(kwargs))
    with pytest.raises(InvalidParameterError) as info:
        SamplingParams(**kwargs)
    assert info.value.param == name
    assert len(info.value.message) < 400  # a bad value is echoed cut short
