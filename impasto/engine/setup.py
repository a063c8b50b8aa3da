"""Build the engine's parts from EngineArgs: model, tokenizer, KV-cache size, scheduler config."""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from impasto.config import (
    DEFAULT_KV_CACHE_BYTES,
    DiffusionConfig,
    EngineArgs,
    EngineConfig,
    ModelConfig,
    SchedulerConfig,
    SpeculativeConfig,
    generation,
)
from impasto.config.block_diffusion import BlockDiffusionConfig, block_architecture
from impasto.config.speculative import check_draft_compat, check_target_compat
from impasto.errors import InvalidParameterError
from impasto.loader.generation_defaults import model_generation_defaults
from impasto.loader.gguf_loader import release_gguf_readers
from impasto.loader.model_loader import load_config, load_model
from impasto.loader.packaged_models import resolve_model
from impasto.loader.tokenizer import (
    get_eos_token_id,
    get_stop_token_ids,
    is_gguf_file,
    load_tokenizer,
)
from impasto.models.interface import CausalLM, DiffusionLM
from impasto.models.layers.embedding import ParallelLMHead
from impasto.models.layers.parallel import agree_min
from impasto.sampling_params import SamplingParams
from impasto.worker.block_diffusion import MaskedBlockRunner
from impasto.worker.device_prep import prepare_for_device
from impasto.worker.diffusion import DiffusionModelRunner
from impasto.worker.kv_cache import kv_cache_bytes_per_block
from impasto.worker.model_runner import ModelRunner

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
    config: EngineConfig
    model_path: Path
    hf_config: Any
    tokenizer: Any
    runner: ModelRunner


def resolve_dtype(name: str, config: Any, gguf: bool) -> torch.dtype:
    if name != "auto":
        return _DTYPES[name]
    if gguf:  # activations of packed (or dequantized) GGUF weights: bf16 runs the fused kernels
        return torch.bfloat16
    configured = getattr(config, "torch_dtype", None) or getattr(config, "dtype", None)
    if configured in (torch.float32, "float32"):
        return torch.float32
    return torch.bfloat16


def build_components(args: EngineArgs) -> EngineComponents:
    """Every tensor-parallel rank calls it (after joining the group): each builds its shard."""
    parallel = args.parallel_config()
    if parallel.num_threads and parallel.tensor_parallel_size == 1:  # TP: per rank, set before
        torch.set_num_threads(parallel.num_threads)
    device = "cuda" if args.device == "auto" and torch.cuda.is_available() else args.device
    device = "cpu" if device == "auto" else device
    path = resolve_model(args.model)
    gguf = is_gguf_file(path)
    config = load_config(path)
    dtype = resolve_dtype(args.dtype, config, gguf)
    if args.quantization == "gguf" and not gguf:
        raise InvalidParameterError(
            "quantization", f"quantization='gguf' needs a GGUF file; {path.name} is not one."
        )
    packed = args.quantization != "none"
    loaded = prepare_for_device(load_model(path, config, dtype, packed).to(device))
    if not isinstance(loaded, CausalLM):
        raise TypeError(f"{type(loaded).__name__} does not implement impasto's model interface")
    model: CausalLM = loaded
    dcfg, limits = None, config  # limits: the config holding ids, vocab and max positions
    if model.is_diffusion:
        dcfg = DiffusionConfig.resolve(args.diffusion_config, config, path)
        limits = getattr(config, "text_config", None) or config
        if args.speculative_config is not None:
            raise InvalidParameterError(
                "speculative_config", "speculative_config cannot be used with a diffusion model."
            )
    blocked = block_architecture(getattr(config, "architectures", None)) is not None
    if parallel.tensor_parallel_size > 1 and (model.is_diffusion or blocked):
        raise InvalidParameterError(
            "tensor_parallel_size",
            "tensor parallelism runs autoregressive models; diffusion and block-diffusion "
            "models run on one rank (use data parallelism for more throughput).",
        )
    if args.diffusion_config is not None and not (model.is_diffusion or blocked):
        raise InvalidParameterError(
            "diffusion_config",
            f"diffusion_config was given, but {path.name} is not a diffusion model.",
        )

    tokenizer = None
    if not args.skip_tokenizer_init:
        tokenizer = load_tokenizer(args.tokenizer or path)
    bcfg = None  # masked block diffusion: an AR body decoded block by block
    if blocked:
        mask_id = getattr(tokenizer, "mask_token_id", None) if tokenizer is not None else None
        bcfg = BlockDiffusionConfig.resolve(args.diffusion_config, config, path, mask_id)
        if args.speculative_config is not None:
            raise InvalidParameterError(
                "speculative_config",
                "speculative_config cannot be used with a block-diffusion model.",
            )
    eos = get_eos_token_id(tokenizer, limits)
    stop_ids = set(get_stop_token_ids(path)) - ({eos} if eos is not None else set())

    max_pos = getattr(limits, "max_position_embeddings", None) or 2048
    max_model_len = args.max_model_len or max_pos
    if max_model_len > max_pos:
        raise InvalidParameterError(
            "max_model_len",
            f"max_model_len ({max_model_len}) is larger than the model's maximum "
            f"({max_pos} positions).",
        )
    spec = args.speculative
    draft = None
    if spec is not None:
        check_target_compat(
            spec, diffusion=args.diffusion_config is not None, max_model_len=max_model_len
        )
        if spec.uses_draft_model:
            draft = _load_draft(spec, config, dtype, device, max_model_len, packed)
    bs = args.block_size
    per_block = kv_cache_bytes_per_block(model, bs, dtype)
    if draft is not None:  # the draft's cache is paged by the same block tables
        per_block += kv_cache_bytes_per_block(draft, bs, dtype)
    if args.num_gpu_blocks_override is not None:
        num_blocks = args.num_gpu_blocks_override
    else:
        budget = args.kv_cache_memory_bytes or DEFAULT_KV_CACHE_BYTES
        num_blocks = budget // per_block
        # No use holding more than every sequence at full length (+ the null block).
        num_blocks = min(num_blocks, args.max_num_seqs * -(-max_model_len // bs) + 1)
    # Ranks may hold different numbers of KV heads (copies where they are fewer than the
    # ranks): every rank takes the blocks all can hold, as rank 0's block tables index them.
    num_blocks = agree_min(num_blocks)
    if (num_blocks - 1) * bs < max_model_len:
        raise InvalidParameterError(
            "kv_cache_memory_bytes",
            f"The KV cache ({num_blocks} blocks of {bs} tokens, {per_block} bytes each) cannot "
            f"hold one sequence of max_model_len={max_model_len} tokens. Increase "
            "kv_cache_memory_bytes / num_gpu_blocks_override or decrease max_model_len.",
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
        num_speculative_tokens=spec.num_speculative_tokens if spec else 0,
        num_lookahead_tokens=spec.num_lookahead_tokens if spec else 0,
        uniform_spec_decode_padding=bool(spec and spec.uniform_spec_decode_padding),
        max_waiting_requests=args.max_waiting_requests,
    )
    runner: ModelRunner
    runner_args: dict[str, Any] = dict(
        num_blocks=num_blocks,
        block_size=bs,
        max_model_len=max_model_len,
        max_num_reqs=args.max_num_seqs,
        dtype=dtype,
        device=device,
        seed=args.seed,
    )
    if bcfg is not None:  # the block travels as spec tokens (with the previous one's commit)
        b = bcfg.block_size
        sched_config = dataclasses.replace(
            sched_config,
            max_num_batched_tokens=max(sched_config.max_num_batched_tokens, 2 * b),
            num_speculative_tokens=2 * b,
            num_sampled_tokens_per_step=0,
            uniform_spec_decode_padding=False,
            masked_block_size=b,
            mask_token_id=bcfg.mask_token_id,
        )
        runner = MaskedBlockRunner(model, config=bcfg, **runner_args)
    elif dcfg is not None:  # the canvas travels as spec tokens; nothing sampled per step
        sched_config = dataclasses.replace(
            sched_config,
            num_speculative_tokens=dcfg.canvas_length,
            num_sampled_tokens_per_step=0,
            uniform_spec_decode_padding=False,
        )
        if not isinstance(model, DiffusionLM):
            raise TypeError(f"{type(model).__name__} does not implement DiffusionLM")
        runner = DiffusionModelRunner(model, diffusion_config=dcfg, **runner_args)
    else:
        runner = ModelRunner(model, **runner_args)
    if spec is not None:
        runner.proposer = _build_proposer(spec, draft, sched_config, dtype, device, args.seed)
    logger.info(
        "impasto: %s (%s, %s), max_model_len=%d, KV cache %d blocks x %d tokens",
        path.name,
        dtype,
        device,
        max_model_len,
        num_blocks,
        bs,
    )
    vocab = int(getattr(limits, "vocab_size", 0) or model.vocab_size)
    release_gguf_readers()  # target and draft are loaded: unmap their files
    model_config = ModelConfig(
        model_path=str(path),
        dtype=str(dtype).removeprefix("torch."),
        max_model_len=max_model_len,
        vocab_size=vocab,
        eos_token_id=eos,
        extra_stop_token_ids=frozenset(stop_ids),
        is_diffusion=dcfg is not None or bcfg is not None,
        block_diffusion=bcfg,
        image_token_id=getattr(model, "image_token_id", None),
        max_logprobs=args.max_logprobs,
        generation_defaults=_generation_defaults(args, path),
    )
    engine_config = EngineConfig(
        model=model_config,
        scheduler=sched_config,
        parallel=parallel,
        observability=args.observability_config(),
        speculative=spec,
        diffusion=dcfg,
    )
    return EngineComponents(engine_config, path, config, tokenizer, runner)


def _generation_defaults(args: EngineArgs, path: Path) -> dict[str, Any]:
    """The model's sampling defaults with the overrides laid over them, checked as a whole
    (a bad value names `generation_config`, or the override that set it)."""
    defaults = model_generation_defaults(path, args.generation_config)
    overrides = generation.check_overrides(args.override_generation_config)
    merged = {**defaults, **overrides}
    try:
        SamplingParams.from_fields(merged)
    except InvalidParameterError as e:
        param = "override_generation_config" if e.param in overrides else "generation_config"
        raise InvalidParameterError(param, f"{param}: {e.message}") from None
    if merged:
        logger.info("impasto: sampling defaults for unset fields: %s", merged)
    return merged


def _load_draft(
    spec: SpeculativeConfig,
    target_config: Any,
    dtype: torch.dtype,
    device: str,
    max_len: int,
    packed: bool = True,
):
    assert spec.model is not None
    draft_path = resolve_model(spec.model)
    draft_config = load_config(draft_path)
    check_draft_compat(
        int(getattr(target_config, "vocab_size", 0)),
        int(getattr(draft_config, "vocab_size", 0)),
        spec.model,
        spec.draft_vocab_size,
    )
    draft_max = getattr(draft_config, "max_position_embeddings", None) or max_len
    if draft_max < max_len:
        raise InvalidParameterError(
            "speculative_config",
            f"The draft model {spec.model!r} handles {draft_max} positions, fewer than "
            f"max_model_len ({max_len}): decrease max_model_len.",
        )
    draft = load_model(draft_path, draft_config, dtype, packed).to(device)
    if spec.draft_vocab_size is not None:  # before device preparation repacks the head
        head = getattr(draft, "lm_head", None)
        if not isinstance(head, ParallelLMHead):
            raise InvalidParameterError(
                "speculative_config",
                f"draft_vocab_size: the draft model {spec.model!r} has no LM head to narrow.",
            )
        head.limit_vocab(spec.draft_vocab_size)
    return prepare_for_device(draft)


def _build_proposer(spec, draft, sched: SchedulerConfig, dtype, device, seed: int):
    from impasto.worker.spec_decode.draft_model import DraftModelProposer
    from impasto.worker.spec_decode.ngram import NgramProposer

    if draft is None:
        return NgramProposer(spec, sched.max_model_len)
    return DraftModelProposer(
        spec,
        draft,
        num_blocks=sched.num_blocks,
        block_size=sched.block_size,
        max_model_len=sched.max_model_len,
        dtype=dtype,
        device=device,
        seed=seed,
    )
