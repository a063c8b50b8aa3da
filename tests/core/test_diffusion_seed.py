"""The bug this project started from: a resumed diffusion request needing exactly one token.

Under KV pressure a diffusion request is preempted; on resume it hits its own cached blocks,
and since prompt_len % block_size == 1 it needs exactly 1 token. AR padding would make that
1 + canvas_length tokens against a canvas_length canvas and kill the engine. It must be
scheduled as a plain 1-token prefill remainder, then canvases of exactly canvas_length.
"""

import random

from impasto.testing import make_requests, make_scheduler

from .fake_runner import FakeRunner

CANVAS = 32


def test_resumed_diffusion_request_gets_one_unpadded_token_then_whole_canvases():
    """Blocks of 64, 65-token prompts, 6 usable blocks. r0 commits fast and grows to a 3rd
    block, which preempts the tail r2 mid-denoise; r2 resumes against its own cached first
    block (hit 64 of 65) while r1 is still denoising: every padding gate but the diffusion
    one is open, and the padded shape would fit the pool."""
    sched = make_scheduler(
        block_size=64,
        num_blocks=7,
        diffusion_canvas_length=CANVAS,
        enable_prefix_caching=True,
        uniform_spec_decode_padding=True,
        max_model_len=384,
    )
    runner = FakeRunner(
        random.Random(0), canvas_length=CANVAS, denoise_steps={"0": 1, "1": 12, "2": 12}
    )
    r0, r1, r2 = make_requests(3, num_tokens=65, max_tokens=CANVAS, ignore_eos=True)
    r0.max_tokens = 2 * CANVAS
    for r in (r0, r1, r2):
        sched.add_request(r)

    resumed_steps = []
    seen_preemption = False
    for _ in range(100):
        if not sched.has_unfinished_requests():
            break
        out = sched.schedule()
        for rid, n in out.num_scheduled_tokens.items():
            spec = out.scheduled_spec_decode_tokens.get(rid)
            assert spec is None or len(spec) == n == CANVAS, (rid, n, spec)
            assert all(t >= 0 for t in spec or [])  # never a padding placeholder
        seen_preemption |= "2" in out.preempted_req_ids
        cached = out.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            if cached.resumed_from_preemption[i]:
                resumed_steps.append((rid, out.num_scheduled_tokens[rid]))
                assert rid not in out.scheduled_spec_decode_tokens
                assert "1" in out.scheduled_spec_decode_tokens  # r1 denoises alongside
        sched.update_from_output(out, runner.execute(out))
        sched.kv_cache_manager.check_integrity()
    assert seen_preemption and resumed_steps == [("2", 1)]
    assert not sched.has_unfinished_requests()
    assert (r0.num_output_tokens, r1.num_output_tokens, r2.num_output_tokens) == (64, 32, 32)
    assert sched.kv_cache_manager.num_free_blocks == 6


def test_fresh_request_fully_cached_while_another_denoises():
    """Same shape without preemption: an identical earlier prompt makes the hit N-1."""
    sched = make_scheduler(
        block_size=16,
        diffusion_canvas_length=CANVAS,
        enable_prefix_caching=True,
        uniform_spec_decode_padding=True,
    )
    runner = FakeRunner(random.Random(1), canvas_length=CANVAS)
    r0, r1 = make_requests(2, num_tokens=33, same_prompt=True, max_tokens=64)
    sched.add_request(r0)
    sched.update_from_output(out := sched.schedule(), runner.execute(out))
    sched.add_request(r1)
    out = sched.schedule()
    assert out.num_scheduled_tokens == {"0": CANVAS, "1": 1}
    assert list(out.scheduled_spec_decode_tokens) == ["0"]
    sched.update_from_output(out, runner.execute(out))
    out = sched.schedule()
    assert out.num_scheduled_tokens == {"0": CANVAS, "1": CANVAS}
