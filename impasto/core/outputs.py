"""The typed objects that cross the scheduler / runner boundary, and per-step stats.

The runner never reaches into scheduler state: everything it needs is in `SchedulerOutput`,
and everything the scheduler learns from a step is in `ModelRunnerOutput`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from impasto.sampling_params import SamplingParams


@dataclass
class NewRequestData:
    """A request the runner has never seen: sent in full."""

    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int  # prefix-cache hit: KV already in these blocks


@dataclass
class CachedRequestData:
    """Requests the runner already knows, as diffs. Parallel lists, one entry per request.

    A request resumed from preemption had its blocks freed: its `new_block_ids` is the whole
    new block table and `resumed_token_ids` carries all its committed tokens (prompt + outputs),
    since the runner dropped its state when it was preempted.
    """

    req_ids: list[str] = field(default_factory=list)
    resumed_from_preemption: list[bool] = field(default_factory=list)
    new_block_ids: list[list[int]] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)
    resumed_token_ids: dict[str, list[int]] = field(default_factory=dict)

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)


@dataclass
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    # Drafts (AR, -1 = padding placeholder) or the diffusion canvas, per request; a subset of
    # the tokens counted in num_scheduled_tokens (they come last in the request's query).
    scheduled_spec_decode_tokens: dict[str, list[int]]
    preempted_req_ids: set[str]
    finished_req_ids: set[str]  # finished since the previous step: the runner drops them
    # Structured outputs: the token masks of this step's constrained requests (the worker's
    # `TokenMasks`, or a future of them filled while the forward pass runs), set by the engine
    # after scheduling; opaque here. None: no constrained request was scheduled.
    grammar_masks: Any = None

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0


@dataclass
class ModelRunnerOutput:
    """What one step produced. `sampled_token_ids[i]` belongs to `req_ids[i]`:
    AR: the accepted drafts plus the bonus/next token (empty for a prefill chunk);
    diffusion: empty for prefill and denoise steps, the committed canvas on a commit step."""

    req_ids: list[str]
    sampled_token_ids: list[list[int]]
    # Next step's drafts / canvas per request (same order), or None when there are none.
    spec_token_ids: list[list[int]] | None = None
    # Per request: one entry per sampled token, each {token_id: (logprob, rank)}.
    logprobs: dict[str, list[dict[int, tuple[float, int]]]] = field(default_factory=dict)
    prompt_logprobs: dict[str, list[dict[int, tuple[float, int]] | None]] = field(
        default_factory=dict
    )
    # Requests whose step failed, with the error message: they finish as errors, alone.
    failed_req_ids: dict[str, str] = field(default_factory=dict)

    def index_of(self) -> dict[str, int]:
        return {rid: i for i, rid in enumerate(self.req_ids)}


@dataclass
class EngineCoreOutput:
    """Per-request result of `update_from_output`: new committed tokens and finish state."""

    req_id: str
    new_token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None
    new_logprobs: list[dict[int, tuple[float, int]]] | None = None
    prompt_logprobs: list[dict[int, tuple[float, int]] | None] | None = None
    error: str | None = None
    num_cached_tokens: int = 0


@dataclass
class SchedulerStats:
    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    kv_cache_usage: float = 0.0
    num_preemptions: int = 0  # this step
    prefix_cache_queries: int = 0  # tokens, this step
    prefix_cache_hits: int = 0
    # Speculative decoding (AR) or canvas (diffusion) accounting, this step.
    num_drafts: int = 0  # requests that verified drafts / evaluated a canvas
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)
