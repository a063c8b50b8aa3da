"""The scheduler: continuous batching with chunked prefill, prefix caching, recompute
preemption, speculative drafts and diffusion canvases — all as "catch up to the target".

A request needs `num_tokens + len(spec_token_ids) - num_computed_tokens` tokens. `schedule()`
hands out a token budget in named phases:

1. `_schedule_running`: running requests in admission order, each getting what it needs
   (`_num_running_tokens`: long-prefill cap, `max_model_len` clamp, whole canvas or nothing),
   its blocks from `_allocate_or_preempt`, which preempts victims until they fit;
2. `schedule_waiting` (`impasto/core/admission.py`, home of the arrival checks too): waiting
   requests admitted head-of-line, with prefix-cache hits and uniform spec-decode padding —
   skipped when the step preempted;
3. `_make_output`, then the optimistic advance of `num_computed_tokens` (drafts and canvas
   included); `update_from_output()` rolls back what was rejected and appends what was committed
   (`impasto/core/commit.py`), then takes what stopped out of `running` and frees it.

`num_sampled_tokens_per_step` (1 AR, 0 diffusion) is read in the `max_model_len` clamp, the
uniform-padding gate and the acceptance arithmetic — and once more to keep a diffusion canvas
whole under the token budget (half a canvas is no denoising step; half a draft list is fine).

Masked block diffusion (`masked_block_size` B > 0) is the same diffusion path with block-causal
KV: a token's KV depends on the rest of its B-block, so `_block_tokens` prefills whole blocks
only, starts a canvas of masks when the request's whole blocks are computed (the prompt's tail
leads it: it shares its block), and the rollback after a step stops at the block boundary
(the tail's KV is written with its block's commit, not before).

Invariants of a step (the cheap ones are asserted at the end of the phases in `schedule()`):

- the budget never goes negative; every scheduled count is positive, and the counts plus the
  budget left add up to `max_num_batched_tokens`;
- `len(running) <= max_num_seqs`: only admission grows `running`, and it checks the limit;
- running requests are served before waiting ones; waiting admission is head-of-line: the first
  request that cannot start (no budget, no blocks, no whole prompt without chunked prefill)
  stops admission, so nobody jumps the queue;
- a step that preempted admits nobody;
- a canvas is never split by the budget (only the `max_model_len` clamp may clip it), and a
  diffusion request is never padded: its spec tokens are the canvas, 1 + canvas overflows it;
- preemption is recompute: the victim is the tail of `running` (the most recently admitted) or,
  under the priority policy, the lowest priority (latest arrival on ties); its blocks are freed
  in reverse (a chain's tail is evicted before its ancestors), its tokens kept, and it goes
  back to the front of the waiting queue. A victim already scheduled in this step gives back
  its budget, spec tokens and new block ids: a preempted request is never in the output's
  scheduled tokens. A request that has to preempt itself ends the running phase;
- spec tokens are consumed when scheduled (`spec_token_ids` is cleared); fresh drafts or the
  updated canvas come back with the step's output.
"""

from __future__ import annotations

from collections.abc import Iterable

from impasto.config.scheduler import SchedulerConfig
from impasto.core.admission import check_new_request, check_waiting_room, schedule_waiting
from impasto.core.commit import commit_step
from impasto.core.kv_cache_manager import KVCacheManager
from impasto.core.outputs import (
    CachedRequestData,
    EngineCoreOutput,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
    SchedulerStats,
)
from impasto.core.request import Request, RequestStatus
from impasto.core.request_queue import make_queue
from impasto.core.schedule_step import ScheduleStep
from impasto.core.spec_stats import SpecStats


class Scheduler:
    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.max_model_len = config.max_model_len
        self.num_spec_tokens = config.num_speculative_tokens
        self.num_sampled_tokens_per_step = config.num_sampled_tokens_per_step
        self.block = config.masked_block_size  # 0: not masked block diffusion
        self.kv_cache_manager = KVCacheManager(
            config.num_blocks,
            config.block_size,
            config.max_model_len,
            config.enable_prefix_caching,
            align=self.block or 1,
        )
        self.requests: dict[str, Request] = {}
        self.running: list[Request] = []  # admission order: the tail is preempted first
        self.waiting = make_queue(config.policy)
        self.finished_req_ids: set[str] = set()
        self._preempted_req_ids: set[str] = set()
        self._step_preemptions = 0
        self._queries_at_last_stats = (0, 0)
        self.spec_stats = SpecStats()
        self.num_preemptions_total = 0

    # -- requests -----------------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        """Queue a request. Refused (nothing changes) when its id is in use or its prompt
        leaves no room to generate: the core never takes a request it cannot run."""
        check_new_request(request, self.requests, self.max_model_len)
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        self.waiting.add(request)

    def check_waiting_room(self, num_requests: int) -> None:
        """Raise `QueueFullError` if `num_requests` new requests would push the requests
        waiting for a seat past `max_waiting_requests`. A free seat in the running batch
        (below `max_num_seqs`) is not a wait: a burst on an idle engine is not refused."""
        check_waiting_room(self.config, len(self.running), len(self.waiting), num_requests)

    def finish_requests(
        self, request_ids: str | Iterable[str] | None, finished_status: RequestStatus
    ) -> list[Request]:
        """Finish requests in any state (abort / error). Unknown or finished ids are ignored."""
        assert RequestStatus.is_finished(finished_status)
        if request_ids is None:
            request_ids = list(self.requests)
        elif isinstance(request_ids, str):
            request_ids = [request_ids]
        done = []
        for rid in request_ids:
            request = self.requests.get(rid)
            if request is None or request.is_finished:
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                self.waiting.remove(request)
            request.status = finished_status
            self._free_request(request, drop_cached=finished_status == RequestStatus.FINISHED_ERROR)
            done.append(request)
        return done

    def _free_request(self, request: Request, drop_cached: bool = False) -> None:
        self.kv_cache_manager.free(request, drop_cached=drop_cached)
        self.finished_req_ids.add(request.request_id)
        del self.requests[request.request_id]

    def get_num_unfinished_requests(self) -> int:
        return len(self.running) + len(self.waiting)

    def has_unfinished_requests(self) -> bool:
        return bool(self.running) or bool(self.waiting)

    # -- scheduling ---------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        """One step: running requests first, then (unless this step preempted) waiting ones."""
        cfg = self.config
        step = ScheduleStep(token_budget=cfg.max_num_batched_tokens)
        self._schedule_running(step)
        if not step.preempted:
            # KV memory is short (the victims sit at the head of the queue): admitting anyone
            # now would only thrash, so a step that preempted admits nobody.
            schedule_waiting(
                cfg,
                self.kv_cache_manager,
                self.waiting,
                self.running,
                step,
                self._block_tokens if self.block else None,
            )

        # The O(1) invariants of the module docstring (the per-request ones are checked by the
        # property tests: a pass over the batch here would cost every step).
        assert step.token_budget >= 0 and len(self.running) <= cfg.max_num_seqs
        assert not (step.preempted and (step.new_reqs or step.resumed_reqs))
        assert not any(r.request_id in step.num_scheduled for r in step.preempted)

        output = self._make_output(step)
        # Optimistic advance: drafts and canvas included; update_from_output rolls back.
        for rid, n in step.num_scheduled.items():
            request = self.requests[rid]
            request.num_computed_tokens += n
            request.is_prefill_chunk = request.num_computed_tokens < request.num_tokens
        self.finished_req_ids = set()
        self._preempted_req_ids = set()
        return output

    def _schedule_running(self, step: ScheduleStep) -> None:
        """Running requests, in admission order, while the budget lasts."""
        # A snapshot, since preemption removes victims from self.running as we go; a victim
        # that had not had its turn yet is skipped, one already scheduled gives its share back.
        for request in list(self.running):
            if step.token_budget <= 0:
                break
            if request.status != RequestStatus.RUNNING:
                continue  # preempted earlier in this step
            if self.block:
                n, masks = self._block_tokens(
                    request, request.num_computed_tokens, step.token_budget
                )
                if masks:
                    request.spec_token_ids = [self.config.mask_token_id] * masks
            else:
                n = self._num_running_tokens(request, step.token_budget)
            if n <= 0:
                continue  # nothing to catch up on, or a canvas the budget cannot take whole
            block_ids = self._allocate_or_preempt(request, n, step)
            if block_ids is None:
                break  # it preempted itself: the cache is held by requests that outrank it
            step.scheduled_running.append(request)
            step.prefill_scheduled |= request.is_prefill_chunk
            step.take(request, n, block_ids)
            if request.spec_token_ids:
                # The drafts (or the canvas) come last in the query; the budget may cut drafts.
                num_spec = n + request.num_computed_tokens - request.num_tokens
                if num_spec > 0:
                    step.spec_tokens[request.request_id] = request.spec_token_ids[:num_spec]
                # Fresh drafts (or the updated canvas) arrive with the step's output.
                request.spec_token_ids = []

    def _num_running_tokens(self, request: Request, token_budget: int) -> int:
        """Tokens to schedule for a running request this step; 0 or less means skip it."""
        cfg = self.config
        s = self.num_sampled_tokens_per_step
        n = request.num_tokens_with_spec - request.num_computed_tokens
        if 0 < cfg.long_prefill_token_threshold < n and not request.spec_token_ids:
            n = cfg.long_prefill_token_threshold
        # AR keeps room for the bonus token; a diffusion canvas may run up to the end.
        n = min(n, self.max_model_len - request.num_computed_tokens - s)
        if s == 0 and request.spec_token_ids and n > token_budget:
            # A canvas is all or nothing: half a canvas is no denoising step. Skip it this
            # step (later requests may still fit); it runs when the budget allows.
            return 0
        return min(n, token_budget)

    def _block_tokens(self, request: Request, computed: int, budget: int) -> tuple[int, int]:
        """Masked block diffusion: (tokens to schedule, masks of a new canvas to start).

        A canvas in flight runs whole or not at all. Without one, the committed tokens before
        the last committed token's block are prefilled in whole blocks; once they all fit, the
        block itself follows in the same step: the prompt's tail (KV unwritten) and masks up to
        the block's end (or max_model_len)."""
        cfg, b = self.config, self.block
        num_tokens = request.num_tokens
        if request.spec_token_ids:
            n = num_tokens + len(request.spec_token_ids) - computed
            return (n if n <= budget else 0), 0
        block_start = num_tokens - num_tokens % b
        prefill = block_start - computed
        cap = budget
        if 0 < cfg.long_prefill_token_threshold < cap:
            cap = cfg.long_prefill_token_threshold
        if prefill > cap:
            return ((cap // b * b) if cfg.enable_chunked_prefill else 0), 0
        block_end = min(block_start + b, self.max_model_len)
        if block_end - computed <= budget:
            return block_end - computed, block_end - num_tokens
        return prefill, 0

    def _allocate_or_preempt(
        self, request: Request, n: int, step: ScheduleStep
    ) -> list[int] | None:
        """Slots for `n` more tokens of a running request, preempting victims until they fit.

        Returns the new block ids, or None when the request had to preempt itself.
        """
        while True:
            block_ids = self.kv_cache_manager.allocate_slots(
                request, n, num_lookahead_tokens=self.config.num_lookahead_tokens
            )
            if block_ids is not None:
                return block_ids
            victim = self._pick_victim()
            self.running.remove(victim)
            step.give_back(victim)  # priority policy: it may have been scheduled already
            self._preempt(victim)
            step.preempted.append(victim)
            if victim is request:
                return None

    def _pick_victim(self) -> Request:
        if self.config.policy == "priority":
            # Lowest priority (largest value), latest arrival on ties.
            return max(self.running, key=lambda r: (r.priority, r.arrival_time))
        return self.running[-1]

    def _preempt(self, request: Request) -> None:
        """Recompute preemption: drop the KV, keep the tokens, requeue at the front. The caller
        has taken it out of `running`."""
        assert request.status == RequestStatus.RUNNING
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.spec_token_ids = []
        request.is_prefill_chunk = False
        request.num_preemptions += 1
        self.num_preemptions_total += 1
        self._step_preemptions += 1
        self.waiting.prepend(request)
        self._preempted_req_ids.add(request.request_id)

    def _make_output(self, step: ScheduleStep) -> SchedulerOutput:
        new_data = [
            NewRequestData(
                req_id=r.request_id,
                prompt_token_ids=r.prompt_token_ids,
                sampling_params=r.sampling_params,
                # The whole table: prefix-cache hits come first, then the new blocks.
                block_ids=self.kv_cache_manager.get_block_ids(r.request_id),
                num_computed_tokens=r.num_computed_tokens,
            )
            for r in step.new_reqs
        ]
        cached = CachedRequestData()
        for r, resumed in (
            *((r, False) for r in step.scheduled_running),
            *((r, True) for r in step.resumed_reqs),
        ):
            cached.req_ids.append(r.request_id)
            cached.resumed_from_preemption.append(resumed)
            if resumed:  # its old blocks were freed: send the whole new table
                cached.new_block_ids.append(self.kv_cache_manager.get_block_ids(r.request_id))
            else:
                cached.new_block_ids.append(step.new_block_ids[r.request_id])
            cached.num_computed_tokens.append(r.num_computed_tokens)
            if resumed:
                cached.resumed_token_ids[r.request_id] = list(r.all_token_ids)
        return SchedulerOutput(
            scheduled_new_reqs=new_data,
            scheduled_cached_reqs=cached,
            num_scheduled_tokens=step.num_scheduled,
            total_num_scheduled_tokens=sum(step.num_scheduled.values()),
            scheduled_spec_decode_tokens=step.spec_tokens,
            preempted_req_ids=self._preempted_req_ids,
            finished_req_ids=self.finished_req_ids,
        )

    # -- results ------------------------------------------------------------------------------
    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        """Commit what a step produced (`commit.commit_step`): roll back rejected drafts /
        canvases, append accepted tokens through the stop check, take the next drafts; then
        finish what stopped or failed: out of `running`, its blocks freed.

        Rule for requests no longer running when the step's results arrive (aborted, or
        preempted between `schedule()` and here, e.g. by `reset_prefix_cache`): their results
        are dropped. A preempted request lost the KV the step computed, so it recomputes and
        samples that position again after it resumes; nothing is committed twice or without
        its KV.
        """
        outputs, stopped = commit_step(
            self.requests,
            scheduler_output,
            runner_output,
            max_model_len=self.max_model_len,
            num_sampled_tokens_per_step=self.num_sampled_tokens_per_step,
            masked_block_size=self.block,
            spec_stats=self.spec_stats,
        )
        if stopped:
            stopped_ids = {r.request_id for r in stopped}
            self.running = [r for r in self.running if r.request_id not in stopped_ids]
            for request in stopped:
                self._free_request(
                    request, drop_cached=request.status == RequestStatus.FINISHED_ERROR
                )
        return outputs

    # -- stats --------------------------------------------------------------------------------
    def make_stats(self) -> SchedulerStats:
        """Stats since the previous call (counters) and now (gauges)."""
        kv = self.kv_cache_manager
        q0, h0 = self._queries_at_last_stats
        self._queries_at_last_stats = (kv.prefix_cache_queries, kv.prefix_cache_hits)
        drafts = self.spec_stats.take()
        stats = SchedulerStats(
            num_running_reqs=len(self.running),
            num_waiting_reqs=len(self.waiting),
            kv_cache_usage=kv.usage,
            num_preemptions=self._step_preemptions,
            prefix_cache_queries=kv.prefix_cache_queries - q0,
            prefix_cache_hits=kv.prefix_cache_hits - h0,
            num_drafts=drafts.num_drafts,
            num_draft_tokens=drafts.num_draft_tokens,
            num_accepted_tokens=drafts.num_accepted_tokens,
            num_accepted_tokens_per_pos=drafts.num_accepted_tokens_per_pos,
        )
        self._step_preemptions = 0
        return stats

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        """Forget every cached block hash; True when done. Only free blocks can be reset, so
        with running requests it fails unless `reset_running_requests`, which first preempts
        them all (recompute; they resume with fresh KV: what weight updates need)."""
        if reset_running_requests:
            # Tail first, as preemption always does, so they requeue in admission order.
            for request in reversed(self.running):
                self._preempt(request)
            self.running = []
        return self.kv_cache_manager.reset_prefix_cache()
