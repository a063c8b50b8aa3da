"""Admission: how a request gets into the scheduler, and from its waiting queue into the
running batch (phase 2 of `Scheduler.schedule()`).

At arrival, `check_new_request` and `check_waiting_room` refuse what the core could never run
or has no room to queue, before anything changes: a refused request is not queued at all.

Each step that preempted nobody, `schedule_waiting` then admits from the head of the queue:

- head-of-line: requests start in queue order, and the first that cannot (no token budget, no
  seat below `max_num_seqs`, no KV blocks, no whole prompt without chunked prefill, no room
  for a masked block) ends admission for the step, so nobody jumps the queue;
- only admission grows `running`, and never past `max_num_seqs`;
- a request starts at its prefix-cache hit (`num_computed_tokens` = the hit); a new one
  records the hit as its cached prompt tokens, a preempted one resumes with a fresh block
  table;
- uniform spec-decode padding: a one-token admission into a decode-only batch with drafts is
  padded to 1 + K with `PADDING_TOKEN_ID` drafts (clamped by the runner, never accepted) —
  never for diffusion, where the spec tokens are the canvas, nor near `max_model_len` or on
  a budget or chunk cap that cannot take 1 + K.
"""

from __future__ import annotations

from collections.abc import Callable

from impasto.config.scheduler import SchedulerConfig
from impasto.core.kv_cache_manager import KVCacheManager
from impasto.core.request import Request, RequestStatus
from impasto.core.request_queue import FCFSQueue, PriorityQueue
from impasto.core.schedule_step import ScheduleStep
from impasto.errors import InvalidParameterError, QueueFullError

PADDING_TOKEN_ID = -1  # placeholder draft: clamped by the runner, never accepted

# Masked block diffusion's token counts for a request: (request, computed, budget) ->
# (tokens to schedule, masks of a new canvas to start); `Scheduler._block_tokens`.
BlockTokens = Callable[[Request, int, int], tuple[int, int]]


def check_new_request(request: Request, requests: dict[str, Request], max_model_len: int) -> None:
    """Refuse a request whose id is in use or whose prompt leaves no room to generate."""
    if request.request_id in requests:
        raise InvalidParameterError(
            "request_id", f"request id {request.request_id!r} is already in use"
        )
    if request.num_tokens >= max_model_len:
        raise InvalidParameterError(
            "prompt",
            f"the prompt has {request.num_tokens} tokens; max_model_len is "
            f"{max_model_len}, which leaves no room to generate.",
        )


def check_waiting_room(
    config: SchedulerConfig, num_running: int, num_waiting: int, num_requests: int
) -> None:
    """Raise `QueueFullError` if `num_requests` more would wait past `max_waiting_requests`;
    free seats in the running batch (below `max_num_seqs`) do not count as waiting."""
    limit = config.max_waiting_requests
    if limit is None:
        return
    free_seats = max(config.max_num_seqs - num_running, 0)
    if num_waiting + num_requests - free_seats > limit:
        raise QueueFullError(num_requests, num_waiting, limit)


def schedule_waiting(
    config: SchedulerConfig,
    kv: KVCacheManager,
    waiting: FCFSQueue | PriorityQueue,
    running: list[Request],
    step: ScheduleStep,
    block_tokens: BlockTokens | None,
) -> None:
    """Admit waiting requests head-of-line: the first that cannot start stops admission.
    `block_tokens` is given for masked block diffusion only."""
    k = config.num_speculative_tokens
    while len(waiting) and step.token_budget > 0 and len(running) < config.max_num_seqs:
        request = waiting.peek()
        hit_blocks, num_hit = kv.get_computed_blocks(request)
        n = request.num_tokens - num_hit
        masks = 0
        pad = block_tokens is None and _should_pad(
            config, n, num_hit, step.token_budget, step.scheduled_running, step.prefill_scheduled
        )
        if block_tokens is not None:
            n, masks = block_tokens(request, num_hit, step.token_budget)
            if n <= 0:
                break
        elif pad:
            n = 1 + k
        elif 0 < config.long_prefill_token_threshold < n:
            n = config.long_prefill_token_threshold
        if not config.enable_chunked_prefill and n > step.token_budget:
            break  # without chunked prefill a prompt runs whole or waits
        n = min(n, step.token_budget)
        block_ids = kv.allocate_slots(
            request,
            n,
            num_new_computed_tokens=num_hit,
            new_computed_blocks=hit_blocks,
            num_lookahead_tokens=config.num_lookahead_tokens,
            full_sequence_must_fit=config.reserve_full_sequence,
        )
        if block_ids is None:
            break
        _admit(kv, waiting, running, request, num_hit, n, block_ids, step)
        if pad:
            step.spec_tokens[request.request_id] = [PADDING_TOKEN_ID] * k
        if masks:  # a masked block starts in this very step
            step.spec_tokens[request.request_id] = [config.mask_token_id] * masks


def _admit(
    kv: KVCacheManager,
    waiting: FCFSQueue | PriorityQueue,
    running: list[Request],
    request: Request,
    num_hit: int,
    n: int,
    block_ids: list[int],
    step: ScheduleStep,
) -> None:
    """Move the head of the waiting queue to running, its prefix-cache hit computed."""
    admitted = waiting.pop()
    assert admitted is request
    kv.record_prefix_query(request.num_tokens, num_hit)
    if request.status == RequestStatus.PREEMPTED:
        step.resumed_reqs.append(request)
    else:
        request.num_cached_prompt_tokens = num_hit
        step.new_reqs.append(request)
    running.append(request)
    request.status = RequestStatus.RUNNING
    request.num_computed_tokens = num_hit
    step.take(request, n, block_ids)


def _should_pad(
    config: SchedulerConfig,
    n: int,
    num_computed: int,
    token_budget: int,
    scheduled_running: list[Request],
    prefill_scheduled: bool,
) -> bool:
    """Uniform spec-decode padding gate. A diffusion request is never padded: its spec tokens
    are the canvas, and 1 + canvas_length overflows it."""
    k = config.num_speculative_tokens
    s = config.num_sampled_tokens_per_step
    padded = 1 + k
    return (
        config.uniform_spec_decode_padding
        and k > 0
        and s > 0
        and n == 1
        and bool(scheduled_running)
        and not prefill_scheduled
        # Near max_model_len, or on a tight budget, schedule it unpadded instead.
        and num_computed + padded + s <= config.max_model_len
        and padded <= token_budget
        and not (0 < config.long_prefill_token_threshold < padded)
    )
