"""The running phase: preemption victims scheduled earlier in the step, not yet served, or the
request itself; and a canvas the budget cannot take whole, skipped without stopping the phase."""

from impasto.core import RequestStatus
from impasto.core.request import Request
from impasto.testing import make_requests, make_scheduler, runner_output


def _request(rid: str, num_tokens: int, priority: int = 0, arrival: float = 0.0) -> Request:
    (r,) = make_requests(
        1,
        num_tokens=num_tokens,
        max_tokens=100,
        req_ids=[rid],
        priorities=[priority],
        arrival_times=[arrival],
    )
    return r


def test_priority_victim_already_scheduled_gives_its_share_back():
    # 4 usable blocks of 4 tokens, a budget of 5, one draft per request.
    sched = make_scheduler(
        block_size=4,
        num_blocks=5,
        max_model_len=16,
        max_num_batched_tokens=5,
        policy="priority",
        num_speculative_tokens=1,
    )
    a = _request("a", 3, priority=5)
    b = _request("b", 2, priority=0, arrival=1.0)
    c = _request("c", 1, priority=1, arrival=2.0)
    sched.add_request(a)
    out = sched.schedule()
    assert out.num_scheduled_tokens == {"a": 3}
    sched.update_from_output(out, runner_output({"a": [1]}, spec={"a": [5]}))
    sched.add_request(b)  # admitted after a: the running order is admission order
    out = sched.schedule()
    assert out.num_scheduled_tokens == {"a": 2, "b": 2}
    sched.update_from_output(out, runner_output({"a": [1], "b": [1]}, spec={"a": [5], "b": [5]}))
    sched.add_request(c)
    out = sched.schedule()
    assert out.num_scheduled_tokens == {"a": 2, "b": 2, "c": 1}
    sampled = {"a": [1], "b": [1], "c": [1]}
    sched.update_from_output(out, runner_output(sampled, spec={r: [5] for r in sampled}))
    assert sched.running == [a, b, c] and sched.kv_cache_manager.num_free_blocks == 0
    # a fits in its blocks and is scheduled first; b needs a new block and the victim is a
    # (lowest priority), already scheduled: it gives back its 2 tokens, draft and block ids,
    # so c, after the preemption, gets both of its tokens instead of 1.
    out = sched.schedule()
    assert list(out.num_scheduled_tokens.items()) == [("b", 2), ("c", 2)]
    assert out.total_num_scheduled_tokens == 4
    assert out.scheduled_spec_decode_tokens == {"b": [5], "c": [5]}
    assert out.preempted_req_ids == {"a"}
    cached = out.scheduled_cached_reqs
    assert cached.req_ids == ["b", "c"] and cached.resumed_from_preemption == [False, False]
    assert len(cached.new_block_ids[0]) == 1 and cached.new_block_ids[1] == []
    assert a.status == RequestStatus.PREEMPTED and a.num_computed_tokens == 0
    assert a.spec_token_ids == [] and sched.waiting.peek() is a
    assert sched.running == [b, c]
    sched.kv_cache_manager.check_integrity()


def test_victim_preempted_before_its_turn_is_skipped():
    # 10 usable blocks of 16 tokens.
    sched = make_scheduler(num_blocks=11, max_model_len=160)
    a = _request("0", 64)  # 4 full blocks
    b, c, d = (_request(str(i), 48, arrival=i) for i in (1, 2, 3))  # 3 full blocks each
    for r in (a, b, c):
        sched.add_request(r)
    out = sched.schedule()
    assert out.num_scheduled_tokens == {"0": 64, "1": 48, "2": 48}
    sched.add_request(d)
    sched.update_from_output(out, runner_output({"0": [1], "1": [1], "2": [1]}))
    b_blocks = list(sched.kv_cache_manager.get_block_ids("1"))
    # a needs a 5th block: the tail c is preempted before its turn; b still runs, and its
    # 4th block comes from what c freed. Nobody is admitted on a step that preempted.
    out = sched.schedule()
    assert list(out.num_scheduled_tokens.items()) == [("0", 1), ("1", 1)]
    assert out.preempted_req_ids == {"2"}
    assert out.scheduled_cached_reqs.req_ids == ["0", "1"]
    assert sched.kv_cache_manager.get_block_ids("1")[:3] == b_blocks
    assert sched.running == [a, b]
    assert list(sched.waiting) == [c, d] and d.status == RequestStatus.WAITING
    sched.kv_cache_manager.check_integrity()


def test_request_that_preempts_itself_ends_the_running_phase():
    # 10 usable blocks of 16 tokens.
    sched = make_scheduler(num_blocks=11, max_model_len=160)
    a = _request("0", 70)  # room left in its 5th block
    b = _request("1", 80, arrival=1.0)  # 5 full blocks
    sched.add_request(a)
    sched.add_request(b)
    out = sched.schedule()
    assert out.num_scheduled_tokens == {"0": 70, "1": 80}
    sched.update_from_output(out, runner_output({"0": [1], "1": [1]}))
    out = sched.schedule()  # b (the tail) needs a 6th block: its only victim is itself
    assert out.num_scheduled_tokens == {"0": 1} and out.preempted_req_ids == {"1"}
    assert sched.running == [a] and sched.waiting.peek() is b
    assert b.status == RequestStatus.PREEMPTED
    sched.kv_cache_manager.check_integrity()


def test_skipped_canvas_does_not_stop_the_running_phase():
    sched = make_scheduler(diffusion_canvas_length=8, max_num_batched_tokens=12, max_model_len=64)
    r0, r1 = _request("0", 1), _request("1", 1, arrival=1.0)
    r2 = _request("2", 20, arrival=2.0)
    for r in (r0, r1, r2):
        sched.add_request(r)
    out = sched.schedule()
    assert out.num_scheduled_tokens == {"0": 1, "1": 1, "2": 10}
    canvas = [1] * 8
    sched.update_from_output(
        out, runner_output({"0": [], "1": [], "2": []}, spec={"0": canvas, "1": canvas})
    )
    out = sched.schedule()
    # r0's canvas leaves 4 tokens: r1's canvas is skipped whole, r2's prefill chunk takes them.
    assert out.num_scheduled_tokens == {"0": 8, "2": 4}
    assert out.scheduled_spec_decode_tokens == {"0": canvas}
    assert r1.spec_token_ids == canvas and r2.is_prefill_chunk
