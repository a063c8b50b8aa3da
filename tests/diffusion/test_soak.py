"""Soak: hundreds of preemption / resume cycles over many diffusion requests, with the
canvas-span invariants checked at every step and no block leaked at the end."""

from __future__ import annotations

import random

from impasto.core.outputs import SchedulerOutput
from impasto.sampling_params import SamplingParams

from .conftest import CANVAS, make_llm

MAX_LEN = 128


def test_soak_preemption_cycles(micro_dg):
    rng = random.Random(7)
    llm = make_llm(
        micro_dg,
        num_gpu_blocks_override=9,
        max_model_len=MAX_LEN,
        max_num_seqs=8,
        max_num_batched_tokens=64,
        diffusion_config={"max_denoising_steps": 3},
    )
    engine = llm.llm_engine
    sched, runner = engine.scheduler, engine.runner
    execute = runner.execute_model
    steps = {"canvas": 0, "one_token_resume": 0}

    def checked(so: SchedulerOutput):
        num_computed = dict(
            zip(
                so.scheduled_cached_reqs.req_ids,
                so.scheduled_cached_reqs.num_computed_tokens,
                strict=True,
            )
        )
        for new in so.scheduled_new_reqs:
            assert new.req_id not in so.scheduled_spec_decode_tokens  # a canvas follows a prefill
        for rid, n in so.num_scheduled_tokens.items():
            canvas = so.scheduled_spec_decode_tokens.get(rid)
            if canvas is None:
                continue
            # exactly its canvas, or the tail clipped at max_model_len; never padded
            assert n == len(canvas) == min(CANVAS, MAX_LEN - num_computed[rid]), (rid, n)
            assert all(0 <= t < 64 for t in canvas)
            steps["canvas"] += 1
        cached = so.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            if cached.resumed_from_preemption[i] and so.num_scheduled_tokens[rid] == 1:
                steps["one_token_resume"] += 1
        return execute(so)

    runner.execute_model = checked
    expected: dict[str, int] = {}
    for i in range(100):
        n = rng.choice([1, 15, 16, 17, 33, rng.randrange(1, 50)])
        prompt = [rng.randrange(3, 64) for _ in range(n)]
        if i % 5 == 0 and i:  # shared prefixes: prefix-cache hits on resume and on admission
            prompt = [5] * 32 + prompt[:17]
        max_tokens = rng.choice([1, 9, 31, 64, None, None, None])
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, seed=rng.randrange(3))
        rid = engine.add_request(None, {"prompt_token_ids": prompt}, params)
        limit = MAX_LEN - len(prompt)
        expected[rid] = min(max_tokens or limit, limit)
    done: dict[str, int] = {}
    produced: dict[str, int] = {}  # the engine's outputs are deltas: sum them
    while engine.has_unfinished_requests():
        for out in engine.step():
            sched.kv_cache_manager.check_integrity()
            rid = out.request_id
            produced[rid] = produced.get(rid, 0) + len(out.outputs[0].token_ids)
            if out.finished:
                assert out.outputs[0].finish_reason == "length"
                done[rid] = produced[rid]
    engine.step()  # lets the runner drop the last finished requests
    m = {x.name: x.value for x in engine.get_metrics()}
    assert done == expected
    assert m["impasto:num_preemptions"] >= 200, m["impasto:num_preemptions"]
    assert steps["one_token_resume"] > 0 and steps["canvas"] > 500
    assert m["impasto:request_failure"] == 0
    kv = sched.kv_cache_manager
    assert kv.num_free_blocks == 9 - 1  # nothing leaked
    assert runner.batch.num_reqs == 0
