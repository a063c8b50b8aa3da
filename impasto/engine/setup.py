"""Build the engine's parts from EngineArgs: model, tokenizer, KV-cache size, scheduler config."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from impasto.core.config import SchedulerConfig
from impasto.engine.args import DEFAULT_KV_CACHE_BYTES, EngineArgs
from impasto.loader.default_model import resolve_model
from impasto.loader.model_loader import load_config, load_model
from impasto.loader.tokenizer import (
    get_eos_token_id,
    get_stop_token_ids,
    is_gguf_file,
    load_tokenizer,
)
from impasto.worker.model_runner import ModelRunner, kv_cache_bytes_per_block

logger = logging.getLogger("impasto")

_DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
}


@dataclass
class EngineComponents:
    model_path: Path
    hf_config: Any
    tokenizer: Any
    eos_token_id: int | None
    extra_stop_ids: set[int]
    vocab_size: int
    scheduler_config: SchedulerConfig
    runner: ModelRunner


def resolve_dtype(name: str, config: Any, gguf: bool) -> torch.dtype:
    if name != "auto":
        return _DTYPES[name]
    if gguf:  # quantized weights are dequantized: bf16 keeps them compact and fast
        return torch.bfloat16
    configured = getattr(config, "torch_dtype", None) or getattr(config, "dtype", None)
    if configured in (torch.float32, "float32"):
        return torch.float32
    return torch.bfloat16


def build_components(args: EngineArgs) -> EngineComponents:
    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    device = "cuda" if args.device == "auto" and torch.cuda.is_available() else args.device
    device = "cpu" if device == "auto" else device
    path = resolve_model(args.model)
    gguf = is_gguf_file(path)
    config = load_config(path)
    dtype = resolve_dtype(args.dtype, config, gguf)
    model = load_model(path, config, dtype).to(device)

    tokenizer = None
    if not args.skip_tokenizer_init:
        tokenizer = load_tokenizer(args.tokenizer or path)
    eos = get_eos_token_id(tokenizer, config)
    stop_ids = set(get_stop_token_ids(path)) - ({eos} if eos is not None else set())

    max_pos = getattr(config, "max_position_embeddings", None) or 2048
    max_model_len = args.max_model_len or max_pos
    if max_model_len > max_pos:
        raise ValueError(
            f"max_model_len ({max_model_len}) is larger than the model's maximum "
            f"({max_pos} positions)."
        )
    bs = args.block_size
    per_block = kv_cache_bytes_per_block(model, bs, dtype)
    if args.num_gpu_blocks_override is not None:
        num_blocks = args.num_gpu_blocks_override
    else:
        budget = args.kv_cache_memory_bytes or DEFAULT_KV_CACHE_BYTES
        num_blocks = budget // per_block
        # No use holding more than every sequence at full length (+ the null block).
        num_blocks = min(num_blocks, args.max_num_seqs * -(-max_model_len // bs) + 1)
    if (num_blocks - 1) * bs < max_model_len:
        raise ValueError(
            f"The KV cache ({num_blocks} blocks of {bs} tokens, {per_block} bytes each) cannot "
            f"hold one sequence of max_model_len={max_model_len} tokens. Increase "
            "kv_cache_memory_bytes / num_gpu_blocks_override or decrease max_model_len."
        )
    batched = args.max_num_batched_tokens or (4096 if args.enable_chunked_prefill else 0)
    if not args.enable_chunked_prefill:
        batched = max(batched, max_model_len)
    sched_config = SchedulerConfig(
        max_model_len=max_model_len,
        max_num_batched_tokens=batched,
        max_num_seqs=args.max_num_seqs,
        block_size=bs,
        num_blocks=num_blocks,
        enable_prefix_caching=args.enable_prefix_caching,
        enable_chunked_prefill=args.enable_chunked_prefill,
        long_prefill_token_threshold=args.long_prefill_token_threshold,
        policy=args.scheduling_policy,
    )
    runner = ModelRunner(
        model,
        num_blocks=num_blocks,
        block_size=bs,
        max_model_len=max_model_len,
        max_num_reqs=args.max_num_seqs,
        dtype=dtype,
        device=device,
        seed=args.seed,
    )
    logger.info(
        "impasto: %s (%s, %s), max_model_len=%d, KV cache %d blocks x %d tokens",
        path.name,
        dtype,
        device,
        max_model_len,
        num_blocks,
        bs,
    )
    vocab = int(getattr(config, "vocab_size", 0) or model.kv_cache_shapes() and config.vocab_size)
    return EngineComponents(path, config, tokenizer, eos, stop_ids, vocab, sched_config, runner)
