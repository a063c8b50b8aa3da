"""The draft-length policy: the measured token cost, and back-off when drafts do not pay."""

from __future__ import annotations

import pytest

from impasto.sampling_params import SamplingParams
from impasto.worker.request_state import RequestState
from impasto.worker.spec_decode import proposer as P
from impasto.worker.spec_decode.proposer import StepCostModel, _policy


def _State() -> RequestState:  # noqa: N802 - a state the policy reads and writes
    return RequestState("r", [1], SamplingParams(), [])


def test_cost_model_recovers_the_slope():
    model = StepCostModel()
    assert model.token_cost() == P.TOKEN_COST  # the prior until the data tell
    a, b = 0.020, 0.0015  # 20 ms per step + 1.5 ms per query row
    for i in range(200):
        rows = 16 + (i * 7) % 17  # 16..32 rows
        model.observe(rows, a + b * rows)
    assert model.token_cost() == pytest.approx(b / a, rel=1e-6)


def test_cost_model_keeps_its_estimate_when_rows_stop_varying():
    model = StepCostModel()
    for i in range(100):
        rows = 4 + i % 8
        model.observe(rows, 0.01 + 0.001 * rows)
    assert model.token_cost() == pytest.approx(0.001 / 0.01)
    for _ in range(500):  # a constant batch: the spread decays, then the fit stops moving
        model.observe(16, 0.05)
    frozen = model.token_cost()
    assert P._COST_RANGE[0] <= frozen <= P._COST_RANGE[1]
    for _ in range(100):
        model.observe(16, 0.08)
    assert model.token_cost() == frozen


def test_cost_model_clips_noise():
    model = StepCostModel()
    for i in range(100):
        model.observe(10 + i % 10, 0.01 - 0.0005 * (i % 10))  # faster with more rows: noise
    assert model.token_cost() == P._COST_RANGE[0]


@pytest.mark.parametrize("alpha", [0.9, 0.3])
def test_policy_drafts_while_it_pays_and_probes_when_it_does_not(alpha):
    tau = 0.4  # e.g. c = 0.05 at 13 requests
    state = _State()
    ks = []
    k = 4
    for _ in range(200):
        accepted = min(k, round(alpha * k)) if k else 0  # a steady acceptance per draft
        k = _policy(state, k, accepted, tau, 4)
        ks.append(k)
    tail = ks[100:]
    if alpha > tau:
        assert min(tail) >= 1
    else:
        assert 0 < sum(1 for k in tail if k > 0) <= len(tail) // 8  # rare one-draft probes
        assert max(tail) == 1
