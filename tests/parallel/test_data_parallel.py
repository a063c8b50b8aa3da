"""Data parallelism offline: `LLM(data_parallel_size=2)` returns what one engine returns.

Two engine processes behind the router, on a tiny random checkpoint (fp32): greedy, seeded
sampling, n > 1 and logprobs are equal to a single in-process engine's for the same requests,
whatever engine each request was routed to; refusals still raise at admission.
"""

from __future__ import annotations

import pytest

from impasto import LLM, SamplingParams
from impasto.errors import InvalidParameterError
from tests.entrypoints.conftest import build_checkpoint

PROMPTS = [[5, 9, 13, 7, 3] * k + [11] for k in (1, 2, 3)] + [[20 + i for i in range(19)]]
# Requests that share a 32-token prefix (two blocks of 16) and differ after it.
ARGS = dict(dtype="float32", seed=0, max_model_len=128, skip_tokenizer_init=True, block_size=16)
SHARED = [[(3 * i) % 150 + 3 for i in range(32)] + [40 + j, 41 + j] for j in range(4)]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return build_checkpoint(tmp_path_factory.mktemp("dp-llama"), "llama")


@pytest.fixture(scope="module")
def single(checkpoint):
    return LLM(str(checkpoint), **ARGS)


@pytest.fixture(scope="module")
def dp(checkpoint):
    llm = LLM(str(checkpoint), **ARGS, data_parallel_size=2)
    yield llm
    llm.shutdown()


def _run(llm: LLM, prompts, params):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [[(c.token_ids, c.finish_reason, c.logprobs) for c in o.outputs] for o in outs]


def _assert_same(got, want):
    """Tokens and finish reasons exactly; logprobs to float32 rounding (a matmul's bits may
    depend on how many rows its batch has, and the engines' batches differ from one's)."""
    assert [[c[:2] for c in o] for o in got] == [[c[:2] for c in o] for o in want]
    for o_got, o_want in zip(got, want, strict=True):
        for (_, _, lp_got), (_, _, lp_want) in zip(o_got, o_want, strict=True):
            assert (lp_got is None) == (lp_want is None)
            for pos_got, pos_want in zip(lp_got or [], lp_want or [], strict=True):
                assert pos_got.keys() == pos_want.keys()
                for t, lp in pos_got.items():
                    assert lp.logprob == pytest.approx(pos_want[t].logprob, abs=1e-4)
                    assert lp.rank == pos_want[t].rank


PARAMS = {
    "greedy": SamplingParams(temperature=0, max_tokens=10),
    "seeded": SamplingParams(temperature=0.9, top_p=0.9, seed=7, max_tokens=10),
    "n2-logprobs": SamplingParams(temperature=0.8, seed=3, n=2, max_tokens=6, logprobs=3),
}


@pytest.mark.parametrize("name", sorted(PARAMS))
def test_outputs_equal_one_engine(single, dp, name):
    params = PARAMS[name]
    _assert_same(_run(dp, PROMPTS + SHARED, params), _run(single, PROMPTS + SHARED, params))


def test_requests_spread_and_prefix_stays(dp):
    before = _routed(dp)
    _run(dp, SHARED, PARAMS["greedy"])
    after = _routed(dp)
    got = {e: after[e] - before.get(e, 0) for e in after}
    # One prefix: the router keeps all four on the engine holding it (loads stay balanced
    # enough for that: at most 4 in flight).
    assert sorted(got.values()) == [0, 4], got


def test_bad_request_refused_at_admission(dp):
    with pytest.raises(InvalidParameterError) as e:
        dp.generate([{"prompt_token_ids": [1, 2, 999]}], SamplingParams(max_tokens=4))
    assert e.value.param == "prompt"
    assert not dp.llm_engine.has_unfinished_requests()


def _routed(llm: LLM) -> dict[str, float]:
    return {
        m.labels["engine"]: m.value
        for m in llm.get_metrics()
        if m.name == "impasto:router_requests"
    }
