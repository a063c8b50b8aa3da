"""What the engine knows about the loaded model once it is resolved: limits and special ids.

Built once by the engine's setup from the checkpoint (and the engine arguments), then shared
read-only: the admission path (`engine/processor.py`) checks requests against it, in the engine
process and, sent over with the `Ready` message, in the API process.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from impasto.config.block_diffusion import BlockDiffusionConfig
from impasto.errors import InvalidParameterError


@dataclass(frozen=True)
class ModelConfig:
    model_path: str
    dtype: str  # resolved: "float32" | "bfloat16" | "float16"
    max_model_len: int
    vocab_size: int
    eos_token_id: int | None = None
    # The model's other end-of-turn ids (generation config), stops unless ignore_eos.
    extra_stop_token_ids: frozenset[int] = field(default_factory=frozenset)
    is_diffusion: bool = False
    # Masked block diffusion (None: any other model): block size, mask id, unmasking defaults.
    block_diffusion: BlockDiffusionConfig | None = None
    image_token_id: int | None = None  # a multimodal checkpoint's image placeholder (refused)
    max_logprobs: int = 20  # -1: no cap
    # SamplingParams defaults for fields a request leaves unset (config/generation.py).
    generation_defaults: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.max_model_len < 1:
            raise InvalidParameterError("max_model_len", "max_model_len must be at least 1.")
        if self.vocab_size < 1:
            raise InvalidParameterError("vocab_size", "the model's vocabulary is empty.")
