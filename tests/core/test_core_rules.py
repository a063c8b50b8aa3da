"""Rules of the core that vLLM's own scheduler tests pin down (and one impasto decides)."""

from __future__ import annotations

import pytest

from impasto.core import RequestStatus
from impasto.errors import InvalidParameterError
from impasto.testing import EOS_TOKEN_ID, make_requests, make_scheduler, runner_output


def test_eos_on_the_last_position_is_a_stop_not_a_length_cap():
    s = make_scheduler(max_num_batched_tokens=16, max_model_len=11)
    (r,) = make_requests(1, num_tokens=10)
    s.add_request(r)
    out = s.update_from_output(s.schedule(), runner_output({"0": [EOS_TOKEN_ID]}))
    assert out[0].finish_reason == "stop" and r.status == RequestStatus.FINISHED_STOPPED


def test_stop_token_that_is_also_the_last_allowed_token_is_a_stop():
    s = make_scheduler()
    (r,) = make_requests(1, num_tokens=4, max_tokens=1, stop_token_ids=[42])
    s.add_request(r)
    out = s.update_from_output(s.schedule(), runner_output({"0": [42]}))
    assert (out[0].finish_reason, out[0].stop_reason) == ("stop", 42)


def test_min_tokens_never_runs_past_the_context():
    s = make_scheduler(max_num_batched_tokens=16, max_model_len=11)
    (r,) = make_requests(1, num_tokens=10, min_tokens=5)
    s.add_request(r)
    out = s.update_from_output(s.schedule(), runner_output({"0": [EOS_TOKEN_ID]}))
    assert out[0].finish_reason == "length"


@pytest.mark.parametrize("caching", [False, True])
def test_a_prompt_without_room_is_refused_with_a_clear_error(caching):
    s = make_scheduler(max_model_len=32, enable_prefix_caching=caching)
    (warm,) = make_requests(1, num_tokens=31, req_ids=["warm"], same_prompt=True)
    s.add_request(warm)
    s.update_from_output(s.schedule(), runner_output({"warm": [7]}))  # cache its blocks
    (long,) = make_requests(1, num_tokens=40, req_ids=["long"], same_prompt=True)
    with pytest.raises(InvalidParameterError, match="max_model_len") as e:
        s.add_request(long)
    assert e.value.param == "prompt" and "long" not in s.requests
    s.kv_cache_manager.check_integrity()


def test_reset_prefix_cache_with_running_requests():
    s = make_scheduler(enable_prefix_caching=True)
    reqs = make_requests(3, num_tokens=40)
    for r in reqs:
        s.add_request(r)
    s.update_from_output(s.schedule(), runner_output({r.request_id: [7] for r in reqs}))
    assert not s.reset_prefix_cache()  # blocks are in use
    assert s.reset_prefix_cache(reset_running_requests=True)
    assert not s.running and [r.request_id for r in s.waiting] == ["0", "1", "2"]
    assert all(r.status == RequestStatus.PREEMPTED and r.num_computed_tokens == 0 for r in reqs)
    assert not s.kv_cache_manager.block_pool.cached
    out = s.schedule()  # they resume, recomputing prompt + output
    assert out.preempted_req_ids == {"0", "1", "2"}
    assert [rid for rid in out.num_scheduled_tokens] == ["0", "1", "2"]
    assert all(n == 41 for n in out.num_scheduled_tokens.values())
    s.kv_cache_manager.check_integrity()


def test_a_token_for_a_request_preempted_mid_step_is_dropped():
    """The rule (documented in update_from_output): a request preempted between schedule() and
    update_from_output() lost the KV the step computed, so what the step sampled for it is
    dropped; it recomputes and samples that position again after it resumes."""
    s = make_scheduler(enable_prefix_caching=True)
    (r,) = make_requests(1, num_tokens=8)
    s.add_request(r)
    so = s.schedule()
    s.reset_prefix_cache(reset_running_requests=True)  # e.g. a weight update mid-step
    assert s.update_from_output(so, runner_output({"0": [7]})) == []
    assert r.output_token_ids == [] and r.status == RequestStatus.PREEMPTED
    assert r.num_computed_tokens == 0
    s.kv_cache_manager.check_integrity()
