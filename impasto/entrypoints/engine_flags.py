"""The engine flags every `impasto` command that builds an engine shares (serve, generate,
chat, tp-worker), with vLLM's names, and their mapping onto EngineArgs fields.

Invariant: a flag the user did not set is absent from `engine_kwargs`, so EngineArgs keeps its
own default (one place for defaults).
"""

from __future__ import annotations

import argparse
import json

from impasto.config.parallel import ParallelConfig


def json_arg(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON: {e}") from e
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("expected a JSON object")
    return value


ENGINE_FLAGS = (
    "tokenizer", "dtype", "quantization", "seed", "max_model_len", "max_num_seqs",
    "max_num_batched_tokens", "block_size", "num_gpu_blocks_override", "kv_cache_memory_bytes",
    "enable_prefix_caching",
    "enable_chunked_prefill", "speculative_config", "diffusion_config", "device", "num_threads",
    "scheduling_policy", "tensor_parallel_size", "data_parallel_size",
    "distributed_executor_backend", "data_parallel_routing",
    "router_balance_abs_threshold", "router_balance_rel_threshold", "router_cache_threshold",
    "max_logprobs", "disable_log_stats",
    "step_timeout_s", "max_waiting_requests", "skip_tokenizer_init",
)  # fmt: skip


def engine_kwargs(args: argparse.Namespace) -> dict:
    """Only the flags the user set: EngineArgs keeps its own defaults."""
    return {k: getattr(args, k) for k in ENGINE_FLAGS if getattr(args, k, None) is not None}


def add_engine_flags(p: argparse.ArgumentParser, positional_model: bool = False) -> None:
    if positional_model:
        p.add_argument("model_tag", nargs="?", default=None, metavar="MODEL")
    p.add_argument("--model", default=None, help="HF folder or GGUF file (default: SmolLM2)")
    p.add_argument("--tokenizer", default=None)
    p.add_argument("--dtype", default=None, choices=["auto", "float32", "bfloat16", "float16"],
                   help="activations and KV cache (GGUF weights stay packed unless "
                        "--quantization none)")  # fmt: skip
    p.add_argument("--quantization", "-q", default=None, choices=["gguf", "none"],
                   help="default: what the file holds (a GGUF file's quantized matrices run "
                        "packed); none: dequantize every weight to --dtype at load")  # fmt: skip
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=None)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--block-size", type=int, default=None)
    p.add_argument("--num-gpu-blocks-override", type=int, default=None)
    p.add_argument("--kv-cache-memory-bytes", type=int, default=None)
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None)
    p.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=None)
    p.add_argument("--speculative-config", type=json_arg, default=None, metavar="JSON")
    p.add_argument("--diffusion-config", type=json_arg, default=None, metavar="JSON")
    p.add_argument("--device", default=None, choices=["auto", "cpu", "cuda"])
    p.add_argument("--num-threads", type=int, default=None, help="CPU threads for torch")
    p.add_argument(
        "--skip-tokenizer-init",
        action="store_true",
        default=None,
        help="no tokenizer: prompts are token ids, outputs token ids only",
    )
    p.add_argument("--scheduling-policy", default=None, choices=["fcfs", "priority"])
    p.add_argument(
        "--tensor-parallel-size",
        "-tp",
        type=int,
        default=None,
        help="shard the model over N ranks (torch.distributed; gloo on CPU)",
    )
    p.add_argument(
        "--data-parallel-size",
        "-dp",
        type=int,
        default=None,
        help="N engines behind one front end, each on its share of the cores",
    )
    p.add_argument(
        "--distributed-executor-backend",
        default=None,
        choices=["mp", "uni", "ray"],
        help="how engine processes start: local processes (mp) or Ray actors (ray)",
    )
    p.add_argument(
        "--data-parallel-routing",
        default=None,
        choices=["prefix_aware", "round_robin", "least_loaded"],
        help="which engine takes a request (default prefix_aware: the longest cached "
        "prefix, balanced against load)",
    )
    p.add_argument(
        "--router-balance-abs-threshold",
        type=int,
        default=None,
        help="prefix-aware routing: loads are out of balance (the idlest engine takes the "
        "request) when the busiest has more than this many requests beyond the idlest "
        f"(default {ParallelConfig.router_balance_abs_threshold}) ...",
    )
    p.add_argument(
        "--router-balance-rel-threshold",
        type=float,
        default=None,
        help="... and more than this many times as many "
        f"(default {ParallelConfig.router_balance_rel_threshold})",
    )
    p.add_argument(
        "--router-cache-threshold",
        type=float,
        default=None,
        help="prefix-aware routing: the fraction of a prompt's blocks a predicted cached "
        f"prefix must cover to decide the engine (default {ParallelConfig.router_cache_threshold})",
    )
    p.add_argument("--max-logprobs", type=int, default=None, help="cap on requested logprobs")
    p.add_argument(
        "--step-timeout",
        dest="step_timeout_s",
        type=float,
        default=None,
        help="seconds a model step may take before its requests fail (default 300; 0: none)",
    )
    p.add_argument("--disable-log-stats", action="store_true", default=None)
    p.add_argument(
        "--max-waiting-requests",
        type=int,
        default=None,
        metavar="N",
        help="bound on the requests waiting for a seat in the running batch (a request with "
        "n choices counts n); past it new requests are refused (HTTP 503 with Retry-After). "
        "Default: unbounded",
    )


def model_of(args: argparse.Namespace) -> str | None:
    return getattr(args, "model_tag", None) or args.model
