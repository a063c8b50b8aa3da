"""Every registered model class implements its declared interface (models/interface.py)."""

from __future__ import annotations

import inspect
from typing import Any, Protocol

import pytest

from impasto.models.interface import CausalLM, DiffusionLM
from impasto.models.registry import get_model_class, supported_architectures
from tests.diffusion.checkpoints import make_config
from tests.models.checkpoints import CONFIGS, TINY


def tiny_config(architecture: str) -> Any:
    """A tiny config per registered architecture (a new one must be added here)."""
    kinds = {
        "LlamaForCausalLM": "llama",
        "MistralForCausalLM": "mistral",
        "Qwen2ForCausalLM": "qwen2",
        "Qwen3ForCausalLM": "qwen3",
        "Gemma3ForCausalLM": "gemma3",
        # Masked block diffusion: the bodies above (config/block_diffusion.py).
        "SDARForCausalLM": "qwen3",
        "Fast_dLLM_QwenForCausalLM": "qwen2",
        "A2DQwen3LMHeadModel": "qwen3",
        "A2DQwen2LMHeadModel": "qwen2",
        "A2DLlamaLMHeadModel": "llama",
        "BlockDiffusionLlamaForCausalLM": "llama",
    }
    if architecture == "DiffusionGemmaForBlockDiffusion":
        return make_config()
    return CONFIGS[kinds[architecture]](**TINY)


def _protocol_methods(proto: type) -> set[str]:
    """The public methods `proto` and the protocols it extends declare."""
    bases = [b for b in proto.__mro__ if getattr(b, "_is_protocol", False) and b is not Protocol]
    return {n for b in bases for n, v in vars(b).items() if inspect.isfunction(v) and n[0] != "_"}


@pytest.mark.parametrize("architecture", supported_architectures())
def test_registered_models_implement_their_interface(architecture):
    cls = get_model_class([architecture])
    model = cls(tiny_config(architecture))
    proto = DiffusionLM if model.is_diffusion else CausalLM
    assert isinstance(model, proto)
    # Beyond presence: each method takes the protocol's parameters, in order, by name.
    for name in sorted(_protocol_methods(proto)):  # (__call__ is nn.Module's, running forward)
        want = list(inspect.signature(getattr(proto, name)).parameters)[1:]
        got = list(inspect.signature(getattr(model, name)).parameters)
        assert got[: len(want)] == want, f"{cls.__name__}.{name}{tuple(got)}: expected {want}"
    assert isinstance(model.vocab_size, int) and model.vocab_size > 0
    if model.is_diffusion:  # usable wherever a CausalLM is (forward without sc rows)
        assert isinstance(model, CausalLM) and isinstance(model.hidden_size, int)
    else:
        assert not isinstance(model, DiffusionLM)
