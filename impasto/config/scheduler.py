"""Scheduler and KV-cache configuration (vLLM's names): frozen, validated at construction."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from impasto.errors import InvalidParameterError


@dataclass(frozen=True)
class SchedulerConfig:
    max_model_len: int
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 256
    block_size: int = 16
    num_blocks: int = 10000  # including the reserved null block
    enable_prefix_caching: bool = False
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0  # 0 disables the per-request chunk cap
    policy: Literal["fcfs", "priority"] = "fcfs"
    # Speculative decoding: K drafts per step (AR). For diffusion, the canvas length.
    num_speculative_tokens: int = 0
    # Extra slots reserved after the scheduled tokens (draft models write K tokens ahead).
    num_lookahead_tokens: int = 0
    # 1 for autoregressive models (the bonus / next token), 0 for diffusion models.
    num_sampled_tokens_per_step: int = 1
    # Pad 1-token admissions to 1 + K (uniform decode batches for full CUDA graphs).
    uniform_spec_decode_padding: bool = False
    # Admit a waiting request only if its whole sequence fits in the free blocks
    # (stops chunked prefill from over-admitting and then thrashing by preemption).
    reserve_full_sequence: bool = True
    # Bound on the requests waiting for a seat in the running batch (None: unbounded); a new
    # request that would exceed it is refused at admission (`QueueFullError`).
    max_waiting_requests: int | None = None
    # Masked block diffusion: the model's block size (0: not such a model) and mask token. The
    # scheduler prefills whole blocks (block-causal KV), starts each block's canvas as masks
    # (the prompt's tail, if any, leads it) and hands the canvas on with the runner's output.
    masked_block_size: int = 0
    mask_token_id: int = -1

    def __post_init__(self) -> None:
        def positive(name: str) -> None:
            if getattr(self, name) < 1:
                raise InvalidParameterError(
                    name, f"{name} must be at least 1, got {getattr(self, name)}."
                )

        for name in ("max_model_len", "max_num_batched_tokens", "max_num_seqs", "block_size"):
            positive(name)
        if self.num_blocks < 2:
            raise InvalidParameterError(
                "num_blocks", f"num_blocks must be at least 2 (one is reserved): {self.num_blocks}."
            )
        if self.max_waiting_requests is not None and self.max_waiting_requests < 0:
            raise InvalidParameterError(
                "max_waiting_requests",
                f"max_waiting_requests must be >= 0 (or None), got {self.max_waiting_requests}.",
            )
        if self.policy not in ("fcfs", "priority"):
            raise InvalidParameterError(
                "policy", f"policy must be 'fcfs' or 'priority', got {self.policy!r}."
            )
        if self.num_sampled_tokens_per_step not in (0, 1):
            raise InvalidParameterError(
                "num_sampled_tokens_per_step",
                "num_sampled_tokens_per_step must be 0 (diffusion) or 1 (AR).",
            )
        if self.num_speculative_tokens < 0 or self.num_lookahead_tokens < 0:
            raise InvalidParameterError(
                "num_speculative_tokens",
                "num_speculative_tokens and num_lookahead_tokens must be >= 0.",
            )
        if self.is_diffusion and self.num_speculative_tokens < 1:
            raise InvalidParameterError(
                "num_speculative_tokens",
                "a diffusion scheduler needs num_speculative_tokens = canvas length.",
            )
        if self.is_diffusion and self.max_num_batched_tokens < self.num_speculative_tokens:
            raise InvalidParameterError(
                "max_num_batched_tokens",
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be at least the "
                f"diffusion canvas length ({self.num_speculative_tokens}).",
            )
        if self.masked_block_size:
            if not self.is_diffusion or self.mask_token_id < 0:
                raise InvalidParameterError(
                    "masked_block_size",
                    "masked block diffusion needs num_sampled_tokens_per_step = 0 and a "
                    "mask_token_id.",
                )
            if self.max_num_batched_tokens < 2 * self.masked_block_size:
                # A block's commit pass rides with the next block's first step: 2 blocks.
                raise InvalidParameterError(
                    "max_num_batched_tokens",
                    f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be at least "
                    f"twice the diffusion block size ({self.masked_block_size}).",
                )
        capacity = (self.num_blocks - 1) * self.block_size
        if capacity < self.max_model_len:
            # Otherwise a long request could end up alone, unable to grow, preempting itself.
            raise InvalidParameterError(
                "max_model_len",
                f"The KV cache holds {capacity} tokens ({self.num_blocks - 1} blocks of "
                f"{self.block_size}), fewer than max_model_len ({self.max_model_len}): one "
                "request at full length would not fit. Increase the KV-cache size or decrease "
                "max_model_len.",
            )
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise InvalidParameterError(
                "max_num_batched_tokens",
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be at least "
                f"max_model_len ({self.max_model_len}) when chunked prefill is disabled.",
            )

    @property
    def is_diffusion(self) -> bool:
        return self.num_sampled_tokens_per_step == 0
