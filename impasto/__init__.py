"""impasto: an LLM inference and serving engine for autoregressive and diffusion LMs.

The top-level names are imported lazily so that `import impasto.core` (pure Python)
never pulls in torch.
"""

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_LAZY = {
    "LLM": "impasto.entrypoints.llm",
    "SamplingParams": "impasto.sampling_params",
    "StructuredOutputsParams": "impasto.structured_outputs",
    "RequestOutput": "impasto.outputs",
    "CompletionOutput": "impasto.outputs",
}

if TYPE_CHECKING:  # pragma: no cover
    from impasto.entrypoints.llm import LLM
    from impasto.outputs import CompletionOutput, RequestOutput
    from impasto.sampling_params import SamplingParams
    from impasto.structured_outputs import StructuredOutputsParams


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'impasto' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)


__all__ = [
    "LLM",
    "SamplingParams",
    "StructuredOutputsParams",
    "RequestOutput",
    "CompletionOutput",
    "__version__",
]
