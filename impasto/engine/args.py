"""Engine arguments, with vLLM's names. Validated at construction with clear errors."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Literal

DEFAULT_KV_CACHE_BYTES = 1 << 30  # 1 GiB when neither a block count nor a budget is given


@dataclass
class EngineArgs:
    model: str | None = None  # None: the default model (SmolLM2-135M-Instruct)
    tokenizer: str | None = None
    skip_tokenizer_init: bool = False
    dtype: str = "auto"  # "auto" | "float32" | "bfloat16" | "float16"
    seed: int = 0
    max_model_len: int | None = None
    block_size: int = 16
    num_gpu_blocks_override: int | None = None
    kv_cache_memory_bytes: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0
    scheduling_policy: Literal["fcfs", "priority"] = "fcfs"
    device: str = "auto"  # "auto" | "cpu" | "cuda"
    speculative_config: dict[str, Any] | None = None
    diffusion_config: dict[str, Any] | None = None
    tensor_parallel_size: int = 1
    num_threads: int | None = None  # CPU threads for torch (default: torch's choice)
    served_model_name: str | None = None

    def __post_init__(self) -> None:
        if self.dtype not in ("auto", "float32", "bfloat16", "float16", "half", "float"):
            raise ValueError(
                f"dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}."
            )
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}.")
        for name in ("max_num_seqs", "max_model_len", "max_num_batched_tokens"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be at least 1, got {value}.")
        if self.num_gpu_blocks_override is not None and self.num_gpu_blocks_override < 2:
            raise ValueError("num_gpu_blocks_override must be at least 2.")
        if self.tensor_parallel_size != 1:
            raise ValueError("tensor_parallel_size > 1 is not supported yet.")
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ValueError("scheduling_policy must be 'fcfs' or 'priority'.")

    @classmethod
    def from_kwargs(cls, model: str | None, **kwargs: Any) -> EngineArgs:
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise TypeError(f"unknown engine argument(s): {', '.join(unknown)}")
        return cls(model=model, **kwargs)
