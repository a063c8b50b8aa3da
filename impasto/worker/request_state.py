"""The runner's own per-request state. Phases are explicit, never inferred from a query length."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from impasto.sampling_params import SamplingParams


class Phase(enum.Enum):
    PREFILL = "prefill"  # committed tokens not all in the KV cache yet: nothing is sampled
    DECODE = "decode"  # AR: every step samples (plus verifies drafts)
    DENOISE = "denoise"  # diffusion: the canvas is refined, KV read-only
    COMMIT = "commit"  # diffusion: the final canvas is written to the KV cache


@dataclass
class RequestState:
    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    output_token_ids: list[int]
    block_ids: list[int]
    num_computed_tokens: int
    phase: Phase = Phase.PREFILL
    extra: dict = field(default_factory=dict)  # model-specific state (e.g. a diffusion canvas)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)
