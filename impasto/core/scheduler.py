"""The scheduler: continuous batching with chunked prefill, prefix caching, recompute
preemption, speculative drafts and diffusion canvases — all as "catch up to the target".

A request needs `num_tokens + len(spec_token_ids) - num_computed_tokens` tokens. `schedule()`
hands out a token budget to running requests first, then admits waiting ones head-of-line,
and advances `num_computed_tokens` optimistically (drafts and canvas included);
`update_from_output()` rolls back what was rejected and appends what was committed.

`num_sampled_tokens_per_step` (1 AR, 0 diffusion) is read in the `max_model_len` clamp, the
uniform-padding gate and the acceptance arithmetic — and once more to keep a diffusion canvas
whole under the token budget (half a canvas is no denoising step; half a draft list is fine).
"""

from __future__ import annotations

from collections.abc import Iterable

from impasto.config.scheduler import SchedulerConfig
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
from impasto.core.spec_stats import SpecStats
from impasto.core.stop import check_stop

PADDING_TOKEN_ID = -1  # placeholder draft: clamped by the runner, never accepted


class Scheduler:
    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.max_model_len = config.max_model_len
        self.num_spec_tokens = config.num_speculative_tokens
        self.num_sampled_tokens_per_step = config.num_sampled_tokens_per_step
        self.kv_cache_manager = KVCacheManager(
            config.num_blocks, config.block_size, config.max_model_len, config.enable_prefix_caching
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
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        self.waiting.add(request)

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
        cfg = self.config
        kv = self.kv_cache_manager
        s = self.num_sampled_tokens_per_step
        token_budget = cfg.max_num_batched_tokens
        num_scheduled: dict[str, int] = {}
        spec_tokens: dict[str, list[int]] = {}
        new_block_ids: dict[str, list[int]] = {}
        scheduled_running: list[Request] = []
        preempted: list[Request] = []
        prefill_scheduled = False

        # Phase A: running requests, in admission order.
        i = 0
        while i < len(self.running) and token_budget > 0:
            request = self.running[i]
            n = request.num_tokens_with_spec - request.num_computed_tokens
            if 0 < cfg.long_prefill_token_threshold < n and not request.spec_token_ids:
                n = cfg.long_prefill_token_threshold
            # AR keeps room for the bonus token; a diffusion canvas may run up to the end.
            n = min(n, self.max_model_len - request.num_computed_tokens - s)
            if s == 0 and request.spec_token_ids and n > token_budget:
                # A canvas is all or nothing: half a canvas is no denoising step. Skip it this
                # step (later requests may still fit); it runs when the budget allows.
                i += 1
                continue
            n = min(n, token_budget)
            if n <= 0:
                i += 1
                continue
            while True:
                block_ids = kv.allocate_slots(
                    request, n, num_lookahead_tokens=cfg.num_lookahead_tokens
                )
                if block_ids is not None:
                    break
                victim = self._pick_victim()
                vi = self.running.index(victim)
                self.running.pop(vi)
                if vi < i:
                    i -= 1
                if victim.request_id in num_scheduled:  # priority policy: give back its share
                    token_budget += num_scheduled.pop(victim.request_id)
                    spec_tokens.pop(victim.request_id, None)
                    new_block_ids.pop(victim.request_id, None)
                    scheduled_running.remove(victim)
                self._preempt(victim)
                preempted.append(victim)
                if victim is request:
                    break
            if block_ids is None:  # the request preempted itself: nothing fits
                break
            scheduled_running.append(request)
            prefill_scheduled |= request.is_prefill_chunk
            num_scheduled[request.request_id] = n
            new_block_ids[request.request_id] = block_ids
            token_budget -= n
            num_spec = n + request.num_computed_tokens - request.num_tokens
            if request.spec_token_ids:
                if num_spec > 0:
                    spec_tokens[request.request_id] = request.spec_token_ids[:num_spec]
                # Fresh drafts (or the updated canvas) arrive with the step's output.
                request.spec_token_ids = []
            i += 1

        # Phase B: waiting requests, head-of-line. A step that preempted admits nobody.
        new_reqs: list[Request] = []
        resumed_reqs: list[Request] = []
        while not preempted and len(self.waiting) and token_budget > 0:
            if len(self.running) >= cfg.max_num_seqs:
                break
            request = self.waiting.peek()
            hit_blocks, num_hit = kv.get_computed_blocks(request)
            n = request.num_tokens - num_hit
            pad = self._should_pad(n, num_hit, token_budget, scheduled_running, prefill_scheduled)
            if pad:
                n = 1 + self.num_spec_tokens
            elif 0 < cfg.long_prefill_token_threshold < n:
                n = cfg.long_prefill_token_threshold
            if not cfg.enable_chunked_prefill and n > token_budget:
                break
            n = min(n, token_budget)
            block_ids = kv.allocate_slots(
                request,
                n,
                num_new_computed_tokens=num_hit,
                new_computed_blocks=hit_blocks,
                num_lookahead_tokens=cfg.num_lookahead_tokens,
                full_sequence_must_fit=cfg.reserve_full_sequence,
            )
            if block_ids is None:
                break
            self.waiting.pop()
            kv.record_prefix_query(request.num_tokens, num_hit)
            if request.status == RequestStatus.PREEMPTED:
                resumed_reqs.append(request)
            else:
                request.num_cached_prompt_tokens = num_hit
                new_reqs.append(request)
            self.running.append(request)
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = num_hit
            num_scheduled[request.request_id] = n
            new_block_ids[request.request_id] = block_ids
            token_budget -= n
            if pad:
                spec_tokens[request.request_id] = [PADDING_TOKEN_ID] * self.num_spec_tokens

        assert token_budget >= 0 and len(self.running) <= cfg.max_num_seqs
        output = self._make_output(
            new_reqs, resumed_reqs, scheduled_running, num_scheduled, spec_tokens, new_block_ids
        )
        # Optimistic advance: drafts and canvas included; update_from_output rolls back.
        for rid, n in num_scheduled.items():
            request = self.requests[rid]
            request.num_computed_tokens += n
            request.is_prefill_chunk = request.num_computed_tokens < request.num_tokens
        self.finished_req_ids = set()
        self._preempted_req_ids = set()
        return output

    def _should_pad(
        self,
        n: int,
        num_computed: int,
        token_budget: int,
        scheduled_running: list[Request],
        prefill_scheduled: bool,
    ) -> bool:
        """Uniform spec-decode padding gate (waiting path). A diffusion request is never padded:
        its spec tokens are the canvas, and 1 + canvas_length overflows it."""
        padded = 1 + self.num_spec_tokens
        return (
            self.config.uniform_spec_decode_padding
            and self.num_spec_tokens > 0
            and self.num_sampled_tokens_per_step > 0
            and n == 1
            and bool(scheduled_running)
            and not prefill_scheduled
            # Near max_model_len, or on a tight budget, schedule it unpadded instead.
            and num_computed + padded + self.num_sampled_tokens_per_step <= self.max_model_len
            and padded <= token_budget
            and not (0 < self.config.long_prefill_token_threshold < padded)
        )

    def _pick_victim(self) -> Request:
        if self.config.policy == "priority":
            # Lowest priority (largest value), latest arrival on ties.
            return max(self.running, key=lambda r: (r.priority, r.arrival_time))
        return self.running[-1]

    def _preempt(self, request: Request) -> None:
        """Recompute preemption: drop the KV, keep the tokens, requeue at the front."""
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

    def _make_output(
        self,
        new_reqs: list[Request],
        resumed_reqs: list[Request],
        scheduled_running: list[Request],
        num_scheduled: dict[str, int],
        spec_tokens: dict[str, list[int]],
        new_block_ids: dict[str, list[int]],
    ) -> SchedulerOutput:
        new_data = [
            NewRequestData(
                req_id=r.request_id,
                prompt_token_ids=r.prompt_token_ids,
                sampling_params=r.sampling_params,
                # The whole table: prefix-cache hits come first, then the new blocks.
                block_ids=self.kv_cache_manager.get_block_ids(r.request_id),
                num_computed_tokens=r.num_computed_tokens,
            )
            for r in new_reqs
        ]
        cached = CachedRequestData()
        for r, resumed in (
            *((r, False) for r in scheduled_running),
            *((r, True) for r in resumed_reqs),
        ):
            cached.req_ids.append(r.request_id)
            cached.resumed_from_preemption.append(resumed)
            if resumed:  # its old blocks were freed: send the whole new table
                cached.new_block_ids.append(self.kv_cache_manager.get_block_ids(r.request_id))
            else:
                cached.new_block_ids.append(new_block_ids[r.request_id])
            cached.num_computed_tokens.append(r.num_computed_tokens)
            if resumed:
                cached.resumed_token_ids[r.request_id] = list(r.all_token_ids)
        return SchedulerOutput(
            scheduled_new_reqs=new_data,
            scheduled_cached_reqs=cached,
            num_scheduled_tokens=num_scheduled,
            total_num_scheduled_tokens=sum(num_scheduled.values()),
            scheduled_spec_decode_tokens=spec_tokens,
            preempted_req_ids=self._preempted_req_ids,
            finished_req_ids=self.finished_req_ids,
        )

    # -- results ------------------------------------------------------------------------------
    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        s = self.num_sampled_tokens_per_step
        index = runner_output.index_of()
        outputs: list[EngineCoreOutput] = []
        stopped: list[Request] = []
        for rid in scheduler_output.num_scheduled_tokens:
            request = self.requests.get(rid)
            if request is None or request.status != RequestStatus.RUNNING:
                continue  # aborted or preempted while the step ran
            error = runner_output.failed_req_ids.get(rid)
            idx = index.get(rid)
            if error is None and idx is None:
                error = "the model runner returned no output for this request"
            if error is not None:
                request.status = RequestStatus.FINISHED_ERROR
                stopped.append(request)
                outputs.append(EngineCoreOutput(rid, [], True, "error", error=error))
                continue
            generated = runner_output.sampled_token_ids[idx]
            scheduled_spec = scheduler_output.scheduled_spec_decode_tokens.get(rid)
            if scheduled_spec and (generated or s == 0):
                # AR: the last sampled token is the bonus/correction; diffusion samples none.
                num_accepted = max(len(generated) - s, 0)
                num_rejected = len(scheduled_spec) - num_accepted
                if num_rejected > 0:
                    request.num_computed_tokens -= num_rejected
                self.spec_stats.observe(len(scheduled_spec), num_accepted)

            new_tokens: list[int] = []
            for token in generated:
                request.append_output_token_ids(token)
                new_tokens.append(token)
                if check_stop(request, self.max_model_len):
                    break  # tokens accepted past a stop are dropped
            finished = request.is_finished
            if finished:
                stopped.append(request)
            elif runner_output.spec_token_ids is not None and not request.is_prefill_chunk:
                request.spec_token_ids = list(runner_output.spec_token_ids[idx])
            if new_tokens or finished:
                logprobs = runner_output.logprobs.get(rid)
                outputs.append(
                    EngineCoreOutput(
                        rid,
                        new_tokens,
                        finished,
                        request.get_finished_reason(),
                        request.stop_reason,
                        new_logprobs=logprobs[: len(new_tokens)] if logprobs else None,
                        prompt_logprobs=runner_output.prompt_logprobs.get(rid),
                        num_cached_tokens=request.num_cached_prompt_tokens,
                    )
                )
            elif rid in runner_output.prompt_logprobs:
                outputs.append(
                    EngineCoreOutput(rid, [], prompt_logprobs=runner_output.prompt_logprobs[rid])
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

    def reset_prefix_cache(self) -> bool:
        return self.kv_cache_manager.reset_prefix_cache()
