"""The runner's own per-request state: typed, one optional field per feature.

Phases are explicit, never inferred from a query length. The state splits in two by lifetime:

- `RequestState` lives from admission to finish: identity, params, the runner's copy of the
  committed output ids, and what must survive preemption (prompt logprobs already delivered);
- `ResidentState` (`state.resident`) lives while the request's KV is resident. Preemption
  replaces it with a fresh one (`on_preempted`), so nothing derived from dropped KV — a canvas,
  a draft model's KV frontier, half-accumulated prompt logprobs — can outlive it, by
  construction.

Block tables and computed-token counts are not kept here: the persistent batch (`InputBatch`)
holds the live values, the scheduler the truth.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from impasto.sampling_params import SamplingParams

if TYPE_CHECKING:  # annotations only: these modules import this one
    import torch

    from impasto.worker.block_diffusion.runner import BlockState
    from impasto.worker.diffusion.sampler import CanvasState
    from impasto.worker.spec_decode.ngram import NgramIndex

# One position's logprobs: {token_id: (logprob, rank)}.
PositionLogprobs = dict[int, tuple[float, int]]


class Phase(enum.Enum):
    PREFILL = "prefill"  # committed tokens not all in the KV cache yet: nothing is sampled
    DECODE = "decode"  # AR: every step samples (plus verifies drafts)
    DENOISE = "denoise"  # diffusion: the canvas is refined, KV read-only
    COMMIT = "commit"  # diffusion: the final canvas is written to the KV cache


@dataclass
class DraftState:
    """A draft model's progress on one request (see spec_decode/draft_model.py)."""

    kv_end: int  # the draft cache holds the draft's KV of every committed position below this
    last_end: int  # the position the last drafts started at
    num_drafted: int  # how many drafts were proposed last step
    probs: torch.Tensor | None = None  # [k, V] the draft's distribution q (random requests)


@dataclass
class SpecPolicyState:
    """Per-request draft-length back-off (see spec_decode/proposer.py)."""

    accepted: float  # decayed count of accepted drafts
    trials: float  # decayed count of trials
    cooldown: int = 0  # steps to wait before probing again
    idle: int = 0  # steps since drafting stopped


@dataclass
class ResidentState:
    """What exists only while the request's KV is in the cache."""

    canvas: CanvasState | None = None  # diffusion: the canvas being denoised
    block: BlockState | None = None  # masked block diffusion: the block being denoised
    # Masked block diffusion with token shift: (p, hidden state at p - 1), p a block start.
    shift_hidden: tuple[int, torch.Tensor] | None = None
    prompt_logprobs: list[PositionLogprobs | None] | None = None  # accumulated chunk by chunk
    draft: DraftState | None = None  # draft-model speculation
    ngram: NgramIndex | None = None  # n-gram speculation: the request's n-gram index
    spec_policy: SpecPolicyState | None = None


@dataclass
class RequestState:
    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    output_token_ids: list[int]  # committed outputs (the runner's copy, for the samplers)
    phase: Phase = Phase.PREFILL
    prompt_logprobs_done: bool = False  # delivered once; never again after a preemption
    resident: ResidentState = field(default_factory=ResidentState)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def on_preempted(self) -> None:
        """Its KV is gone: restart from a prefill with nothing derived from that KV."""
        self.phase = Phase.PREFILL
        self.resident = ResidentState()
