"""Model classes keyed by the HF `architectures` names they implement."""

from __future__ import annotations

import importlib

from torch import nn

# architecture name -> (module under impasto.models, class name); imported lazily
_MODELS: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("llama", "MistralForCausalLM"),
    "Qwen2ForCausalLM": ("qwen2", "Qwen2ForCausalLM"),
    "Qwen3ForCausalLM": ("qwen3", "Qwen3ForCausalLM"),
    "Gemma3ForCausalLM": ("gemma3", "Gemma3ForCausalLM"),
    "DiffusionGemmaForBlockDiffusion": ("diffusion_gemma", "DiffusionGemmaForBlockDiffusion"),
    # Masked block diffusion: the AR bodies, decoded block by block (config/block_diffusion.py).
    "SDARForCausalLM": ("qwen3", "Qwen3ForCausalLM"),
    "Fast_dLLM_QwenForCausalLM": ("qwen2", "Qwen2ForCausalLM"),
    "A2DQwen3LMHeadModel": ("qwen3", "Qwen3ForCausalLM"),
    "A2DQwen2LMHeadModel": ("qwen2", "Qwen2ForCausalLM"),
    "A2DLlamaLMHeadModel": ("llama", "LlamaForCausalLM"),
    "BlockDiffusionLlamaForCausalLM": ("llama", "LlamaForCausalLM"),
}


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def register_model(architecture: str, module: str, class_name: str) -> None:
    """Add an architecture; `module` is a full import path or a name under impasto.models."""
    _MODELS[architecture] = (module, class_name)


def get_model_class(architectures: list[str]) -> type[nn.Module]:
    for arch in architectures or []:
        if arch in _MODELS:
            module, name = _MODELS[arch]
            path = module if "." in module else f"impasto.models.{module}"
            return getattr(importlib.import_module(path), name)
    raise ValueError(
        f"unsupported model architecture(s) {list(architectures or [])}; "
        f"supported: {supported_architectures()}"
    )
