"""Uniform spec-decode padding: when it fires and, above all, when it must not (diffusion)."""

from impasto.core import Request, RequestStatus
from impasto.sampling_params import SamplingParams
from impasto.testing import EOS_TOKEN_ID, make_requests, make_scheduler, runner_output


def _two_requests_one_decoding(scheduler, num_tokens=33):
    """r0 prefills and gets drafts; then r1 with the same prompt arrives (prefix hit N-1)."""
    r0, r1 = make_requests(2, num_tokens=num_tokens, same_prompt=True)
    scheduler.add_request(r0)
    out = scheduler.schedule()
    assert out.num_scheduled_tokens == {"0": num_tokens}
    return r0, r1, out


def test_padding_fires_on_first_decode_step_prefix_hit():
    sched = make_scheduler(num_speculative_tokens=3, enable_prefix_caching=True)
    r0, r1, out = _two_requests_one_decoding(sched)
    sched.update_from_output(out, runner_output({"0": [100]}, spec={"0": [1, 2, 3]}))
    sched.add_request(r1)
    out = sched.schedule()
    assert out.num_scheduled_tokens == {"0": 4, "1": 4}
    assert out.scheduled_spec_decode_tokens == {"0": [1, 2, 3], "1": [-1, -1, -1]}
    assert r1.num_computed_tokens == 32 + 4  # optimistic, placeholders included
    # The placeholders are always rejected: net progress 1 token, as if unpadded.
    sched.update_from_output(out, runner_output({"0": [1, 7], "1": [9]}, spec={"0": [], "1": []}))
    assert r1.num_computed_tokens == 33
    assert r1.output_token_ids == [9]
    assert r0.num_computed_tokens == 35 and r0.num_tokens == 36
    sched.kv_cache_manager.check_integrity()


def test_padding_skipped_for_diffusion():
    canvas = 16
    sched = make_scheduler(diffusion_canvas_length=canvas, enable_prefix_caching=True)
    r0, r1, out = _two_requests_one_decoding(sched)
    sched.update_from_output(out, runner_output({"0": []}, spec={"0": list(range(canvas))}))
    sched.add_request(r1)
    out = sched.schedule()
    assert out.num_scheduled_tokens == {"0": canvas, "1": 1}
    assert "1" not in out.scheduled_spec_decode_tokens
    assert out.scheduled_spec_decode_tokens["0"] == list(range(canvas))


def test_padding_skipped_with_prefill_chunk_running():
    sched = make_scheduler(
        num_speculative_tokens=3, enable_prefix_caching=True, max_num_batched_tokens=128
    )
    a = make_requests(1, num_tokens=33, same_prompt=True)[0]
    b = Request("b", [7] * 100, SamplingParams(max_tokens=16), EOS_TOKEN_ID)
    c = make_requests(1, num_tokens=33, same_prompt=True, req_ids=["c"])[0]
    sched.add_request(a)
    sched.add_request(b)
    out = sched.schedule()
    assert out.num_scheduled_tokens == {"0": 33, "b": 95}  # b is a prefill chunk
    sched.update_from_output(out, runner_output({"0": [100], "b": []}, spec={"0": [1, 2, 3]}))
    sched.add_request(c)
    out = sched.schedule()
    assert out.num_scheduled_tokens == {"0": 4, "b": 5, "c": 1}
    assert "c" not in out.scheduled_spec_decode_tokens


def test_padding_skipped_without_running_requests():
    sched = make_scheduler(num_speculative_tokens=3, enable_prefix_caching=True)
    r0, r1 = make_requests(2, num_tokens=33, same_prompt=True)
    sched.add_request(r0)
    out = sched.schedule()
    sched.update_from_output(out, runner_output({"0": []}))
    sched.finish_requests("0", RequestStatus.FINISHED_ABORTED)
    sched.add_request(r1)
    out = sched.schedule()
    assert out.num_scheduled_tokens == {"1": 1}
    assert out.scheduled_spec_decode_tokens == {}


def test_unpadded_near_max_model_len():
    sched = make_scheduler(num_speculative_tokens=3, enable_prefix_caching=True, max_model_len=36)
    r0, r1, out = _two_requests_one_decoding(sched)
    sched.update_from_output(out, runner_output({"0": [100]}, spec={"0": [1, 2, 3]}))
    sched.add_request(r1)
    out = sched.schedule()
    # 32 + (1 + 3) + 1 > 36: no room for the padded query and its bonus token.
    assert out.num_scheduled_tokens["1"] == 1
    assert "1" not in out.scheduled_spec_decode_tokens
    # r0 is clamped to leave room for its bonus token: 36 - 33 - 1 = 2 tokens, 1 draft.
    assert out.num_scheduled_tokens["0"] == 2
    assert out.scheduled_spec_decode_tokens["0"] == [1]


def test_unpadded_when_padding_does_not_fit_budget():
    r0, r1 = make_requests(2, num_tokens=33, same_prompt=True)
    sched = make_scheduler(
        num_speculative_tokens=3,
        enable_prefix_caching=True,
        max_num_batched_tokens=6,
        max_model_len=100,
    )
    sched.add_request(r0)
    while r0.is_prefill_chunk or r0.num_computed_tokens == 0:
        out = sched.schedule()
        done = r0.num_computed_tokens >= r0.num_tokens
        sched.update_from_output(
            out, runner_output({"0": [100] if done else []}, spec={"0": [1, 2, 3]})
        )
    sched.add_request(r1)
    out = sched.schedule()
    assert out.num_scheduled_tokens == {"0": 4, "1": 1}  # 2 left: 4 would not fit
    assert "1" not in out.scheduled_spec_decode_tokens


def test_padding_disabled_by_config():
    sched = make_scheduler(
        num_speculative_tokens=3, enable_prefix_caching=True, uniform_spec_decode_padding=False
    )
    r0, r1, out = _two_requests_one_decoding(sched)
    sched.update_from_output(out, runner_output({"0": [100]}, spec={"0": [1, 2, 3]}))
    sched.add_request(r1)
    out = sched.schedule()
    assert out.num_scheduled_tokens == {"0": 4, "1": 1}
