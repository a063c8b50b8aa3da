"""Property-based test: random workloads through the scheduler with a fake runner.

After every step: budgets respected, running <= max_num_seqs, block integrity, diffusion
requests get exactly their canvas (or its tail clipped at max_model_len) or a prefill chunk —
never 1 + canvas; masked block-diffusion requests get whole prefill blocks and then exactly
their block (the finished one riding along), never padding (the fake runner checks the
span). At the end: every request finished exactly once and no block leaked.
"""

from __future__ import annotations

import random

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from impasto.core import Request, RequestStatus
from impasto.core.admission import PADDING_TOKEN_ID
from impasto.core.outputs import SchedulerOutput
from impasto.sampling_params import SamplingParams
from impasto.testing import EOS_TOKEN_ID, make_scheduler

from .fake_runner import FakeRunner

MODES = ["ar", "ar_spec", "diffusion", "block"]
MASK = 3


class SchedulerMachine(RuleBasedStateMachine):
    @initialize(
        mode=st.sampled_from(MODES),
        block_size=st.sampled_from([4, 16]),
        num_blocks=st.integers(12, 80),
        chunked=st.booleans(),
        caching=st.booleans(),
        max_num_seqs=st.integers(1, 6),
        budget=st.integers(16, 160),
        padding=st.booleans(),
        seed=st.integers(0, 2**16),
    )
    def setup(
        self, mode, block_size, num_blocks, chunked, caching, max_num_seqs, budget, padding, seed
    ):
        self.mode = mode
        self.canvas = 8 if mode == "diffusion" else 0
        self.k = 3 if mode == "ar_spec" else 0
        self.block = 4 if mode == "block" else 0
        self.max_model_len = min(96, (num_blocks - 1) * block_size)
        if not chunked:
            budget = max(budget, self.max_model_len)
        budget = max(budget, self.canvas, 2 * self.block)
        self.budget = budget
        self.block_size = block_size
        self.sched = make_scheduler(
            block_size=block_size,
            num_blocks=num_blocks,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=budget,
            max_model_len=self.max_model_len,
            enable_prefix_caching=caching,
            enable_chunked_prefill=chunked,
            num_speculative_tokens=self.k or None,
            diffusion_canvas_length=self.canvas or None,
            uniform_spec_decode_padding=padding,
            masked_block_size=self.block,
            mask_token_id=MASK,
        )
        self.rng = random.Random(seed)
        self.runner = FakeRunner(
            self.rng,
            num_spec_tokens=self.k,
            canvas_length=self.canvas,
            denoise_steps=2,
            vocab=8,  # tiny vocab: repeated prompts and outputs make prefix hits common
            eos_token_id=EOS_TOKEN_ID,
            eos_prob=0.05,
            masked_block=(self.block, MASK, self.max_model_len) if self.block else None,
        )
        self.next_id = 0
        self.finished: dict[str, RequestStatus] = {}
        self.all_ids: set[str] = set()

    # -- rules --------------------------------------------------------------------------------
    @rule(prompt_len=st.integers(1, 60), max_tokens=st.integers(1, 40), prefix=st.integers(0, 3))
    def add_request(self, prompt_len, max_tokens, prefix):
        rid = str(self.next_id)
        self.next_id += 1
        # Shared prefixes (a few fixed heads) make prefix-cache hits and N-1 hits happen.
        prompt = [prefix] * min(prompt_len, 33) + [
            self.rng.randrange(8) for _ in range(prompt_len - 33)
        ]
        if len(prompt) >= self.max_model_len:
            prompt = prompt[: self.max_model_len - 1]
        req = Request(rid, prompt, SamplingParams(max_tokens=max_tokens), EOS_TOKEN_ID)
        self.sched.add_request(req)
        self.all_ids.add(rid)

    @rule()
    def step(self):
        self._step()

    @precondition(lambda self: bool(self.sched.requests))
    @rule(data=st.data())
    def abort(self, data):
        rid = data.draw(st.sampled_from(sorted(self.sched.requests)))
        done = self.sched.finish_requests(rid, RequestStatus.FINISHED_ABORTED)
        for r in done:
            self._record_finish(r.request_id, r.status)

    # -- helpers ------------------------------------------------------------------------------
    def _record_finish(self, rid: str, status: RequestStatus) -> None:
        assert rid not in self.finished, f"request {rid} finished twice"
        assert RequestStatus.is_finished(status)
        self.finished[rid] = status

    def _step(self) -> SchedulerOutput:
        before = {
            rid: (r.num_tokens, r.num_computed_tokens) for rid, r in self.sched.requests.items()
        }
        out = self.sched.schedule()
        self._check_output(out, before)
        outputs = self.sched.update_from_output(out, self.runner.execute(out))
        for o in outputs:
            if o.finished:
                self._record_finish(o.req_id, RequestStatus.FINISHED_STOPPED)
        return out

    def _check_output(self, out: SchedulerOutput, before: dict[str, tuple[int, int]]) -> None:
        assert out.total_num_scheduled_tokens <= self.budget
        assert sum(out.num_scheduled_tokens.values()) == out.total_num_scheduled_tokens
        assert len(self.sched.running) <= self.sched.config.max_num_seqs
        for rid, n in out.num_scheduled_tokens.items():
            assert n > 0
            spec = out.scheduled_spec_decode_tokens.get(rid, [])
            assert len(spec) < n or ((self.canvas or self.block) and len(spec) == n)
            num_tokens, computed = before[rid]
            if rid in out.preempted_req_ids:
                continue
            if self.block:  # its block (after whole prefill blocks), or whole prefill blocks
                assert PADDING_TOKEN_ID not in spec
                assert computed % self.block == 0 or rid not in self.sched.running
                if spec:
                    end = num_tokens + len(spec)
                    assert end - (end - 1) // self.block * self.block <= self.block
                    assert len(spec) <= 2 * self.block
            elif self.canvas:
                if spec:
                    clipped = self.max_model_len - computed
                    assert len(spec) == n and n in (self.canvas, clipped), (n, clipped)
                else:  # a prefill chunk never runs past the committed tokens
                    resumed = computed == 0 or rid not in self.sched.running
                    assert n <= num_tokens - (0 if resumed else computed) or resumed
            else:
                assert len(spec) <= max(self.k, 0)
        self.sched.kv_cache_manager.check_integrity()

    @invariant()
    def integrity(self):
        if hasattr(self, "sched"):
            self.sched.kv_cache_manager.check_integrity()

    def teardown(self):
        if not hasattr(self, "sched"):
            return
        for _ in range(2000):
            if not self.sched.has_unfinished_requests():
                break
            self._step()
        assert not self.sched.has_unfinished_requests(), "requests never finished"
        assert set(self.finished) == self.all_ids, "a request was lost"
        kv = self.sched.kv_cache_manager
        assert kv.num_free_blocks == kv.block_pool.num_blocks - 1, "leaked blocks"
        assert not kv.req_to_blocks
        kv.check_integrity()


SchedulerMachine.TestCase.settings = settings(
    max_examples=80,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestSchedulerProperties = SchedulerMachine.TestCase
