"""Scheduler scenarios: budgets, chunking, rollback, preemption, stops, aborts, priority."""

import pytest

from impasto.core import RequestStatus
from impasto.testing import EOS_TOKEN_ID, make_requests, make_scheduler, runner_output


def test_schedule_all_new_requests():
    sched = make_scheduler()
    for r in make_requests(5, num_tokens=10):
        sched.add_request(r)
    out = sched.schedule()
    assert out.num_scheduled_tokens == {str(i): 10 for i in range(5)}
    assert [d.req_id for d in out.scheduled_new_reqs] == ["0", "1", "2", "3", "4"]
    assert len(sched.running) == 5 and len(sched.waiting) == 0
    assert out.total_num_scheduled_tokens == 50


def test_chunked_prefill_and_budget():
    sched = make_scheduler(max_num_batched_tokens=64, max_model_len=1000)
    a, b = make_requests(2, num_tokens=100)
    sched.add_request(a)
    sched.add_request(b)
    out = sched.schedule()
    assert out.num_scheduled_tokens == {"0": 64}
    assert a.is_prefill_chunk
    sched.update_from_output(out, runner_output({"0": []}))
    out = sched.schedule()
    assert out.num_scheduled_tokens == {"0": 36, "1": 28}
    assert not a.is_prefill_chunk and b.is_prefill_chunk
    sched.update_from_output(out, runner_output({"0": [5], "1": []}))
    assert a.output_token_ids == [5] and b.output_token_ids == []


def test_head_of_line_blocking_without_chunked_prefill():
    sched = make_scheduler(max_num_batched_tokens=100, enable_chunked_prefill=False)
    a, b, c = make_requests(3, num_tokens=60)
    for r in (a, b, c):
        sched.add_request(r)
    out = sched.schedule()
    assert out.num_scheduled_tokens == {"0": 60}  # b does not fit whole: b and c wait


def test_long_prefill_token_threshold():
    sched = make_scheduler(long_prefill_token_threshold=16, max_model_len=1000)
    a, b = make_requests(2, num_tokens=40)
    sched.add_request(a)
    sched.add_request(b)
    out = sched.schedule()
    assert out.num_scheduled_tokens == {"0": 16, "1": 16}


def test_max_num_seqs():
    sched = make_scheduler(max_num_seqs=2)
    for r in make_requests(3):
        sched.add_request(r)
    out = sched.schedule()
    assert set(out.num_scheduled_tokens) == {"0", "1"}


def test_ar_spec_rollback_partial_acceptance():
    sched = make_scheduler(num_speculative_tokens=3)
    (r,) = make_requests(1, num_tokens=10)
    sched.add_request(r)
    out = sched.schedule()
    sched.update_from_output(out, runner_output({"0": [100]}, spec={"0": [1, 2, 3]}))
    assert (r.num_tokens, r.num_computed_tokens) == (11, 10)
    out = sched.schedule()
    assert out.num_scheduled_tokens == {"0": 4} and r.num_computed_tokens == 14
    sched.update_from_output(out, runner_output({"0": [1, 5]}, spec={"0": [4, 4, 4]}))
    # 1 draft accepted, 2 rejected: rolled back to num_tokens - 1.
    assert r.output_token_ids == [100, 1, 5]
    assert (r.num_tokens, r.num_computed_tokens) == (13, 12)
    stats = sched.make_stats()
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (1, 3, 1)
    assert stats.num_accepted_tokens_per_pos == [1]


def test_diffusion_rollback_denoise_and_commit():
    canvas = [7] * 16
    sched = make_scheduler(diffusion_canvas_length=16)
    (r,) = make_requests(1, num_tokens=10, max_tokens=64)
    sched.add_request(r)
    out = sched.schedule()
    sched.update_from_output(out, runner_output({"0": []}, spec={"0": canvas}))
    assert r.spec_token_ids == canvas
    out = sched.schedule()  # denoise: the whole canvas, no bonus slot
    assert out.num_scheduled_tokens == {"0": 16} and out.scheduled_spec_decode_tokens["0"] == canvas
    assert r.num_computed_tokens == 26
    sched.update_from_output(out, runner_output({"0": []}, spec={"0": canvas}))
    assert r.num_computed_tokens == 10 and r.num_tokens == 10  # all rolled back
    out = sched.schedule()  # commit: the canvas comes back as sampled tokens
    sched.update_from_output(out, runner_output({"0": list(range(16))}, spec={"0": canvas}))
    assert r.num_computed_tokens == 26 and r.num_tokens == 26
    assert r.output_token_ids == list(range(16))
    stats = sched.make_stats()
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (2, 32, 16)


def test_diffusion_canvas_clipped_at_max_model_len():
    sched = make_scheduler(diffusion_canvas_length=16, max_model_len=20)
    (r,) = make_requests(1, num_tokens=10, max_tokens=64)
    sched.add_request(r)
    out = sched.schedule()
    sched.update_from_output(out, runner_output({"0": []}, spec={"0": list(range(16))}))
    out = sched.schedule()
    assert out.num_scheduled_tokens == {"0": 10}
    assert out.scheduled_spec_decode_tokens["0"] == list(range(10))
    outputs = sched.update_from_output(out, runner_output({"0": list(range(10))}))
    assert outputs[0].finish_reason == "length" and r.num_tokens == 20


@pytest.mark.parametrize(
    "kwargs,sampled,expected_tokens,reason,stop_reason",
    [
        ({}, [1, EOS_TOKEN_ID, 3], [1, EOS_TOKEN_ID], "stop", None),
        ({"ignore_eos": True}, [1, EOS_TOKEN_ID, 3], [1, EOS_TOKEN_ID, 3], None, None),
        ({"stop_token_ids": [42]}, [1, 42, 3], [1, 42], "stop", 42),
        (
            {"min_tokens": 3},
            [EOS_TOKEN_ID, 1, EOS_TOKEN_ID],
            [EOS_TOKEN_ID, 1, EOS_TOKEN_ID],
            "stop",
            None,
        ),
        ({"max_tokens": 2}, [1, 2, 3], [1, 2], "length", None),
    ],
)
def test_stop_checks_trim_multi_token_outputs(
    kwargs, sampled, expected_tokens, reason, stop_reason
):
    sched = make_scheduler(num_speculative_tokens=3)
    (r,) = make_requests(1, num_tokens=10, **kwargs)
    sched.add_request(r)
    out = sched.schedule()
    sched.update_from_output(out, runner_output({"0": []}, spec={"0": [1, 2]}))
    r.spec_token_ids = [1, 2]
    out = sched.schedule()
    outputs = sched.update_from_output(out, runner_output({"0": sampled}))
    assert r.output_token_ids == expected_tokens
    assert outputs[0].finish_reason == reason and outputs[0].stop_reason == stop_reason
    if reason:
        assert "0" not in sched.requests and "0" in sched.finished_req_ids


def test_preempt_tail_and_admit_nobody_that_step():
    # 10 usable blocks of 16: two 80-token requests take 5 each.
    sched = make_scheduler(num_blocks=11, max_model_len=160)
    a, b, c = make_requests(3, num_tokens=80, max_tokens=100)
    for r in (a, b):
        sched.add_request(r)
    out = sched.schedule()
    assert out.num_scheduled_tokens == {"0": 80, "1": 80}
    sched.add_request(c)
    sched.update_from_output(out, runner_output({"0": [1], "1": [1]}))
    out = sched.schedule()  # a needs a 6th block: b (tail) is preempted
    assert out.num_scheduled_tokens == {"0": 1}
    assert out.preempted_req_ids == {"1"}
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    assert sched.waiting.peek() is b  # front of the queue, before c
    assert c.status == RequestStatus.WAITING  # nobody admitted on a preempting step
    sched.kv_cache_manager.check_integrity()
    sched.update_from_output(out, runner_output({"0": [2]}))
    sched.finish_requests("0", RequestStatus.FINISHED_ABORTED)
    out = sched.schedule()
    # b comes back first (6 blocks); c's whole prompt (5 blocks) would not fit beside it.
    assert out.scheduled_new_reqs == [] and c.status == RequestStatus.WAITING
    cached = out.scheduled_cached_reqs
    assert cached.req_ids == ["1"] and cached.resumed_from_preemption == [True]
    assert cached.resumed_token_ids["1"] == [1] * 80 + [1]
    assert out.num_scheduled_tokens["1"] == 81  # prompt + its output, recomputed


def test_priority_preempts_lowest_priority():
    sched = make_scheduler(num_blocks=11, max_model_len=160, policy="priority")
    a, b = make_requests(2, num_tokens=80, max_tokens=100, priorities=[5, 0])
    sched.add_request(a)
    sched.add_request(b)
    out = sched.schedule()
    assert list(out.num_scheduled_tokens) == ["1", "0"]  # b first: lower value wins
    sched.update_from_output(out, runner_output({"0": [1], "1": [1]}))
    out = sched.schedule()
    assert out.preempted_req_ids == {"0"} and out.num_scheduled_tokens == {"1": 1}


@pytest.mark.parametrize("state", ["waiting", "running", "preempted", "in_flight", "finished"])
def test_abort_in_every_state(state):
    sched = make_scheduler(num_blocks=11, max_model_len=160)
    a, b = make_requests(2, num_tokens=80, max_tokens=100)
    sched.add_request(a)
    target = a
    if state != "waiting":
        sched.add_request(b)
        out = sched.schedule()
        sched.update_from_output(out, runner_output({"0": [1], "1": [1]}))
    if state == "preempted":
        out = sched.schedule()
        sched.update_from_output(out, runner_output({"0": [2]}))
        target = b
        assert b.status == RequestStatus.PREEMPTED
    if state == "in_flight":
        out = sched.schedule()
    if state == "finished":
        sched.finish_requests("0", RequestStatus.FINISHED_ABORTED)
    done = sched.finish_requests(target.request_id, RequestStatus.FINISHED_ABORTED)
    assert (len(done) == 1) == (state != "finished")
    assert target.status == RequestStatus.FINISHED_ABORTED
    assert target.request_id not in sched.requests
    if state == "in_flight":  # the late output of an aborted request is ignored
        outputs = sched.update_from_output(out, runner_output({"0": [3], "1": [3]}))
        assert all(o.req_id != "0" for o in outputs)
    sched.kv_cache_manager.check_integrity()
    sched.finish_requests(None, RequestStatus.FINISHED_ABORTED)
    assert sched.kv_cache_manager.num_free_blocks == 10
    assert not sched.has_unfinished_requests()


def test_failed_request_finishes_alone_and_uncaches():
    sched = make_scheduler(enable_prefix_caching=True)
    a, b = make_requests(2, num_tokens=40)
    sched.add_request(a)
    sched.add_request(b)
    out = sched.schedule()
    res = runner_output({"1": [4]})
    res.failed_req_ids["0"] = "boom"
    outputs = sched.update_from_output(out, res)
    by_id = {o.req_id: o for o in outputs}
    assert by_id["0"].finish_reason == "error" and by_id["0"].error == "boom"
    assert by_id["1"].new_token_ids == [4] and b.status == RequestStatus.RUNNING
    assert make_requests(1, num_tokens=40)[0].block_hashes == []
    assert sched.kv_cache_manager.get_computed_blocks(make_requests(1, num_tokens=40)[0])[1] == 0
    sched.kv_cache_manager.check_integrity()


def test_duplicate_request_id_rejected():
    sched = make_scheduler()
    sched.add_request(make_requests(1)[0])
    with pytest.raises(ValueError, match="already in use"):
        sched.add_request(make_requests(1)[0])


def test_prefix_cache_stats_counted_at_admission():
    sched = make_scheduler(enable_prefix_caching=True)
    a, b = make_requests(2, num_tokens=33, same_prompt=True)
    sched.add_request(a)
    sched.update_from_output(sched.schedule(), runner_output({"0": [1]}))
    sched.add_request(b)
    sched.schedule()
    stats = sched.make_stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (66, 32)


def test_diffusion_canvas_is_all_or_nothing_under_the_budget():
    sched = make_scheduler(diffusion_canvas_length=8, max_num_batched_tokens=17)
    reqs = make_requests(3, num_tokens=1, max_tokens=8)
    for r in reqs:
        sched.add_request(r)
    out = sched.schedule()
    sched.update_from_output(
        out,
        runner_output({r.request_id: [] for r in reqs}, spec={r.request_id: [1] * 8 for r in reqs}),
    )
    out = sched.schedule()
    # 17 tokens: two whole canvases; the third is skipped, not cut to 1 token.
    assert out.num_scheduled_tokens == {"0": 8, "1": 8}
    assert reqs[2].spec_token_ids == [1] * 8  # kept for the next step


def test_config_rejects_a_pool_smaller_than_one_full_request():
    with pytest.raises(ValueError, match="fewer than max_model_len"):
        make_scheduler(num_blocks=5, block_size=16, max_model_len=100)


def test_new_and_resumed_requests_carry_their_whole_block_table():
    sched = make_scheduler(enable_prefix_caching=True, block_size=4)
    a, b = make_requests(2, num_tokens=10, same_prompt=True)
    sched.add_request(a)
    sched.add_request(b)
    out = sched.schedule()
    new = {d.req_id: d for d in out.scheduled_new_reqs}
    assert new["1"].num_computed_tokens == 8  # a's first two blocks, cached this very step
    assert new["1"].block_ids == new["0"].block_ids[:2] + [4]
    assert new["1"].block_ids == sched.kv_cache_manager.get_block_ids("1")
