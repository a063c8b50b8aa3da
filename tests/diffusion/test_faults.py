"""Faults injected into the diffusion runner under load (an exception in the forward, NaN /
inf logits in a denoising step, a hung step): the requests hit finish with an error, every
other one finishes token-identical to a fault-free run (seeded canvases do not depend on the
batch), and no KV block or runner row is left behind."""

from __future__ import annotations

import random

import pytest

from impasto.sampling_params import SamplingParams
from impasto.testing import Arrival, FaultInjector, WorkloadResult, run_workload

from .conftest import make_llm


def _workload() -> list[Arrival]:
    rng = random.Random(3)
    shared = [rng.randrange(3, 64) for _ in range(20)]
    out = []
    for i in range(12):
        prompt = shared + [rng.randrange(3, 64) for _ in range(rng.randrange(1, 20))]
        params = SamplingParams(max_tokens=rng.choice([9, 16, 31]), ignore_eos=True, seed=i)
        out.append(Arrival(i // 3, f"d{i}", prompt, params))
    return out


def _engine(path, **kwargs):
    args = dict(
        num_gpu_blocks_override=12,
        max_model_len=128,
        max_num_seqs=4,
        max_num_batched_tokens=64,
        diffusion_config={"max_denoising_steps": 3},
    )
    return make_llm(path, **{**args, **kwargs}).llm_engine


@pytest.fixture(scope="module")
def reference(micro_dg) -> WorkloadResult:
    ref = run_workload(_engine(micro_dg), _workload())
    assert set(ref.reasons.values()) == {"length"}
    assert ref.metrics["impasto:num_preemptions"] > 0
    return ref


@pytest.mark.parametrize("kind", ["raise", "nan", "inf", "hang"])
def test_faults_fail_only_their_requests(micro_dg, reference, kind):
    rng = random.Random(sum(map(ord, kind)))
    steps = sorted(rng.sample(range(2, reference.steps // 3), 2))
    engine = _engine(micro_dg, step_timeout_s=0.4 if kind == "hang" else None)
    injector = FaultInjector(engine.runner, kind, steps, hang_s=1.0, seed=5)
    got = run_workload(engine, _workload())
    injector.uninstall()
    failed = {rid for rid, reason in got.reasons.items() if reason == "error"}
    assert len(injector.hit) == 2
    if kind in ("nan", "inf"):
        assert len(failed) == 2 and failed <= set().union(*injector.hit)
    else:
        assert failed == set().union(*injector.hit)
    for rid, tokens in reference.tokens.items():
        if rid not in failed:
            assert tokens == got.tokens[rid], f"{rid} diverged from the fault-free run"
    assert got.metrics["impasto:step_failed_requests"] == len(failed)
