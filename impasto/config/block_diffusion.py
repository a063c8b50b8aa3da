"""Masked block diffusion: the model's attention/canvas contract and the unmasking defaults.

A masked block-diffusion model (SDAR, Fast-dLLM v2, dllm's AR-to-diffusion conversions, ...) is an
ordinary Qwen2 / Qwen3 / Llama body run with another attention mask: sequences are cut into
blocks of `block_size` tokens at absolute positions 0, B, 2B, ...; a token attends to every
token of its own block and of the blocks before it (block-causal). Decoding fills one block at a
time: the block starts as `mask_token_id` (after the prompt's tail when the prompt ends inside
it) and an unmasking algorithm commits positions step by step. With `token_shift` the logits of
position i are read from the hidden state at i - 1 (Fast-dLLM v2: next-token prediction kept
from the AR base), so the block's first slot is predicted by the previous block's last token.

Where the values come from (lowest precedence first): the architecture's published defaults
(`ARCHITECTURES`), the checkpoint's config.json keys (`block_size` / `bd_size`,
`mask_token_id`, `token_shift`), the tokenizer's mask token, `generation_config.json`
(`dllm_*` keys), then the `diffusion_config` engine argument. A request may choose its own
algorithm parameters (`SamplingParams.extra_args`, vLLM's `vllm_xargs` over HTTP) but never
another block size: the KV cache of a block-causal model is only valid for the block size the
model was trained with.

Pure Python (the config layer): the algorithms themselves live in `worker/block_diffusion/`.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from impasto.errors import InvalidParameterError

ALGORITHMS = ("low_confidence", "top_k", "entropy_bounded", "random")


@dataclass(frozen=True)
class ArchitectureDefaults:
    block_size: int | None  # None: not in the published checkpoints; must come from elsewhere
    mask_token_id: int | None
    token_shift: bool


# Published defaults per architecture (SDAR README / SGLang's dllm table; Fast-dLLM v2 model
# card; dllm's A2D conversions, whose block size is a sampler argument: BD3LM's default 32).
# The body each runs on is in the model registry (models/registry.py).
ARCHITECTURES: dict[str, ArchitectureDefaults] = {
    "SDARForCausalLM": ArchitectureDefaults(4, 151669, False),
    "Fast_dLLM_QwenForCausalLM": ArchitectureDefaults(32, 151665, True),
    "A2DQwen3LMHeadModel": ArchitectureDefaults(32, None, False),
    "A2DQwen2LMHeadModel": ArchitectureDefaults(32, None, False),
    "A2DLlamaLMHeadModel": ArchitectureDefaults(32, None, False),
    # impasto's own adaptations (examples/train_block_diffusion.py): a Llama body.
    "BlockDiffusionLlamaForCausalLM": ArchitectureDefaults(None, None, True),
}
# model_type strings of those checkpoints (custom code upstream) -> the body's model_type.
MODEL_TYPES = {
    "sdar": "qwen3",
    "fast_dllm_qwen": "qwen2",
    "a2d-qwen3": "qwen3",
    "a2d-qwen2": "qwen2",
    "a2d-llama": "llama",
    "block_diffusion_llama": "llama",
}
_ALGORITHM_KEYS = ("algorithm", "threshold", "k_per_step", "entropy_bound", "max_steps")


def block_architecture(architectures: list[str] | None) -> ArchitectureDefaults | None:
    for arch in architectures or []:
        if arch in ARCHITECTURES:
            return ARCHITECTURES[arch]
    return None


@dataclass(frozen=True)
class UnmaskingParams:
    """How one block is decoded (per request; defaults from the engine's config).

    - `low_confidence`: commit every masked position whose candidate probability is > threshold,
      at least the single most confident one per step (SDAR's dynamic, Fast-dLLM, SGLang);
    - `top_k`: the `k_per_step` most confident positions per step (LLaDA2's k_step, SDAR static);
    - `entropy_bounded`: the lowest-entropy positions while the sum of their entropies minus the
      largest stays within `entropy_bound` (at least one);
    - `random`: `k_per_step` masked positions drawn uniformly (seeded by position and step).
    After `max_steps` steps of a block (0: the block size) every position left is committed.
    """

    algorithm: str = "low_confidence"
    threshold: float = 0.9
    k_per_step: int = 1
    entropy_bound: float = 0.5
    max_steps: int = 0

    def __post_init__(self) -> None:
        def bad(name: str, why: str) -> InvalidParameterError:
            return InvalidParameterError(name, f"{name} {why}, got {getattr(self, name)!r}.")

        if self.algorithm not in ALGORITHMS:
            raise bad("algorithm", f"must be one of {list(ALGORITHMS)}")
        if not isinstance(self.threshold, (int, float)) or not 0.0 <= self.threshold < 1.0:
            raise bad("threshold", "must be a number in [0, 1)")
        if not isinstance(self.k_per_step, int) or self.k_per_step < 1:
            raise bad("k_per_step", "must be a positive integer")
        if not isinstance(self.entropy_bound, (int, float)) or self.entropy_bound <= 0:
            raise bad("entropy_bound", "must be a positive number")
        if not isinstance(self.max_steps, int) or self.max_steps < 0:
            raise bad("max_steps", "must be an integer >= 0 (0: the block size)")

    def steps_cap(self, block_size: int) -> int:
        return self.max_steps or block_size

    def override(self, extra_args: dict[str, Any] | None, block_size: int) -> UnmaskingParams:
        """The request's own parameters (`extra_args`), checked: unknown keys and another block
        size are refused, naming the key."""
        if not extra_args:
            return self
        values: dict[str, Any] = {}
        for key, value in extra_args.items():
            name = key.removeprefix("dllm_")
            if name == "block_size":
                if value != block_size:
                    raise InvalidParameterError(
                        "block_size",
                        f"block_size {value!r} is not this model's: it decodes blocks of "
                        f"{block_size} tokens (its KV cache is only valid for them).",
                    )
                continue
            if name not in _ALGORITHM_KEYS:
                raise InvalidParameterError(
                    key,
                    f"unknown extra argument {key!r} for a block-diffusion model; supported: "
                    f"{sorted(_ALGORITHM_KEYS) + ['block_size']} (optionally prefixed dllm_)",
                )
            values[name] = value
        return replace(self, **values)


@dataclass(frozen=True)
class BlockDiffusionConfig:
    block_size: int
    mask_token_id: int
    token_shift: bool = False
    unmasking: UnmaskingParams = field(default_factory=UnmaskingParams)

    def __post_init__(self) -> None:
        if not isinstance(self.block_size, int) or self.block_size < 1:
            raise InvalidParameterError(
                "diffusion_config", f"block_size must be a positive integer, got {self.block_size}"
            )
        if not isinstance(self.mask_token_id, int) or self.mask_token_id < 0:
            raise InvalidParameterError(
                "diffusion_config", f"mask_token_id must be a token id, got {self.mask_token_id}"
            )

    @classmethod
    def resolve(
        cls,
        overrides: dict[str, Any] | None,
        hf_config: Any,
        model_path: Path | None,
        tokenizer_mask_id: int | None = None,
    ) -> BlockDiffusionConfig:
        arch = block_architecture(getattr(hf_config, "architectures", None))
        values: dict[str, Any] = {}
        if arch is not None:
            values = {"block_size": arch.block_size, "mask_token_id": arch.mask_token_id}
            values["token_shift"] = arch.token_shift
        for key, name in (("bd_size", "block_size"), ("block_size", "block_size")):
            if getattr(hf_config, key, None) is not None:
                values[name] = int(getattr(hf_config, key))
        for name in ("mask_token_id", "token_shift"):
            if getattr(hf_config, name, None) is not None:
                values[name] = getattr(hf_config, name)
        if values.get("mask_token_id") is None and tokenizer_mask_id is not None:
            values["mask_token_id"] = tokenizer_mask_id
        algo: dict[str, Any] = {}
        gen = model_path / "generation_config.json" if model_path is not None else None
        if gen is not None and gen.is_file():
            data = json.loads(gen.read_text())
            algo.update({k: data[f"dllm_{k}"] for k in _ALGORITHM_KEYS if f"dllm_{k}" in data})
        names = {"block_size", "mask_token_id", "token_shift", *_ALGORITHM_KEYS}
        unknown = sorted(set(overrides or {}) - names)
        if unknown:
            raise InvalidParameterError(
                "diffusion_config",
                f"unknown diffusion_config key(s) {unknown} for a block-diffusion model; "
                f"supported: {sorted(names)}",
            )
        for key, value in (overrides or {}).items():
            (algo if key in _ALGORITHM_KEYS else values)[key] = value
        for name in ("block_size", "mask_token_id"):
            if values.get(name) is None:
                raise InvalidParameterError(
                    "diffusion_config",
                    f"the checkpoint does not say its {name}: pass diffusion_config="
                    f'{{"{name}": ...}}',
                )
        return cls(
            block_size=values["block_size"],
            mask_token_id=values["mask_token_id"],
            token_shift=bool(values.get("token_shift", False)),
            unmasking=UnmaskingParams(**algo),
        )

    def to_dict(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "unmasking"}
        return out | asdict(self.unmasking)
