"""Engine arguments, with vLLM's names: what a user passes to `LLM(...)` or `impasto serve`.

Frozen and validated at construction: every bad value raises `InvalidParameterError` naming
the argument, before anything is loaded. `speculative_config` is parsed here (a dict in,
a `SpeculativeConfig` out); what needs the checkpoint (max_model_len against the model's
positions, the diffusion settings, the KV-cache size) is resolved once by the engine's setup
into an `EngineConfig`.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Literal

from impasto.config import generation
from impasto.config.observability import ObservabilityConfig
from impasto.config.parallel import ParallelConfig
from impasto.config.speculative import SpeculativeConfig
from impasto.errors import InvalidParameterError

DEFAULT_KV_CACHE_BYTES = 1 << 30  # 1 GiB when neither a block count nor a budget is given
DTYPES = ("auto", "float32", "bfloat16", "float16", "half", "float")
# None / "gguf": a GGUF file's quantized matrices run packed (what the file holds); "none":
# dequantize every weight to `dtype` at load (impasto's own value, for comparisons).
QUANTIZATIONS = (None, "gguf", "none")


@dataclass(frozen=True)
class EngineArgs:
    model: str | None = None  # None: the default model (SmolLM2-135M-Instruct)
    tokenizer: str | None = None
    skip_tokenizer_init: bool = False
    dtype: str = "auto"  # activations and KV cache: "auto" | "float32" | "bfloat16" | "float16"
    quantization: str | None = None  # see QUANTIZATIONS
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
    speculative_config: SpeculativeConfig | dict[str, Any] | None = None
    diffusion_config: dict[str, Any] | None = None
    tensor_parallel_size: int = 1
    data_parallel_size: int = 1  # engines behind one front end (config/parallel.py)
    distributed_executor_backend: str | None = None  # "mp" (default) | "uni" | "ray"
    data_parallel_routing: str = "prefix_aware"  # | "round_robin" | "least_loaded"
    # the prefix-aware router's knobs (defaults and meaning: config/parallel.py)
    router_balance_abs_threshold: int = ParallelConfig.router_balance_abs_threshold
    router_balance_rel_threshold: float = ParallelConfig.router_balance_rel_threshold
    router_cache_threshold: float = ParallelConfig.router_cache_threshold
    num_threads: int | None = None  # CPU threads for torch (default: torch's choice)
    served_model_name: str | None = None
    max_logprobs: int = 20  # top logprobs a request may ask for (vLLM's default)
    disable_log_stats: bool = False
    # The step watchdog's deadline (None or 0: off; vLLM's default is 300 s too). A step running
    # longer fails its requests; one still running 4 deadlines later ends the engine.
    step_timeout_s: float | None = 300.0
    max_waiting_requests: int | None = None  # bound on the waiting queue (None: unbounded)
    # Where sampling defaults come from: "auto" (the model's), "vllm" (none) or a folder with a
    # generation_config.json; overrides are laid over them (config/generation.py).
    generation_config: str = "auto"
    override_generation_config: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        def bad(name: str, message: str) -> InvalidParameterError:
            return InvalidParameterError(name, message)

        if self.quantization not in QUANTIZATIONS:
            raise bad(
                "quantization",
                f"quantization {self.quantization!r} is not supported; impasto runs GGUF files "
                "packed (None or 'gguf'), or dequantized with 'none'.",
            )
        if self.dtype not in DTYPES:
            raise bad(
                "dtype", f"dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}."
            )
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise bad("block_size", f"block_size must be a power of two, got {self.block_size}.")
        for name in ("max_num_seqs", "max_model_len", "max_num_batched_tokens"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise bad(name, f"{name} must be at least 1, got {value}.")
        mwr = self.max_waiting_requests
        if mwr is not None and (type(mwr) is not int or mwr < 0):
            raise bad(
                "max_waiting_requests",
                f"max_waiting_requests must be an integer >= 0 (or None), got {mwr!r}.",
            )
        if self.num_gpu_blocks_override is not None and self.num_gpu_blocks_override < 2:
            raise bad("num_gpu_blocks_override", "num_gpu_blocks_override must be at least 2.")
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise bad("scheduling_policy", "scheduling_policy must be 'fcfs' or 'priority'.")
        if type(self.max_logprobs) is not int or self.max_logprobs < -1:
            raise bad("max_logprobs", "max_logprobs must be an integer >= -1 (-1: no cap).")
        if self.device not in ("auto", "cpu", "cuda"):
            raise bad("device", f"device must be auto, cpu or cuda, got {self.device!r}.")
        t = self.step_timeout_s
        if t is not None and (isinstance(t, bool) or not isinstance(t, int | float) or not t >= 0):
            raise bad("step_timeout_s", f"step_timeout_s must be >= 0 seconds, got {t!r}.")
        if t == 0:
            object.__setattr__(self, "step_timeout_s", None)  # 0: no deadline
        if not isinstance(self.generation_config, str) or not self.generation_config:
            raise bad("generation_config", "generation_config must be auto, vllm or a folder.")
        generation.check_overrides(self.override_generation_config)
        self.parallel_config()  # validates the parallel arguments
        if self.speculative_config is not None:
            spec = SpeculativeConfig.from_dict(self.speculative_config)
            object.__setattr__(self, "speculative_config", spec)  # parsed once, here
        if self.diffusion_config is not None and not isinstance(self.diffusion_config, dict):
            raise bad("diffusion_config", "diffusion_config must be a dict.")

    @classmethod
    def from_kwargs(cls, model: str | None, **kwargs: Any) -> EngineArgs:
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise TypeError(f"unknown engine argument(s): {', '.join(unknown)}")
        return cls(model=model, **kwargs)

    @property
    def speculative(self) -> SpeculativeConfig | None:
        """The parsed speculative config (None: speculation off)."""
        spec = self.speculative_config
        assert spec is None or isinstance(spec, SpeculativeConfig)
        return spec

    def parallel_config(self) -> ParallelConfig:
        return ParallelConfig(
            tensor_parallel_size=self.tensor_parallel_size,
            data_parallel_size=self.data_parallel_size,
            distributed_executor_backend=self.distributed_executor_backend,
            data_parallel_routing=self.data_parallel_routing,
            router_balance_abs_threshold=self.router_balance_abs_threshold,
            router_balance_rel_threshold=self.router_balance_rel_threshold,
            router_cache_threshold=self.router_cache_threshold,
            num_threads=self.num_threads,
        )

    def observability_config(self) -> ObservabilityConfig:
        return ObservabilityConfig(disable_log_stats=self.disable_log_stats)
