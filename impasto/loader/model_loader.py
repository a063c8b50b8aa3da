"""Load a model from an HF folder (config.json + safetensors) or a GGUF file."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn
from transformers import PretrainedConfig

from impasto.loader.hf import default_dtype
from impasto.loader.tokenizer import is_gguf_file


def load_config(path: Path) -> PretrainedConfig:
    if is_gguf_file(path):
        from impasto.loader.gguf_loader import gguf_to_hf_config

        return gguf_to_hf_config(path)
    from impasto.loader.hf import read_hf_config

    if not (path / "config.json").exists():
        raise ValueError(f"{path} is neither a GGUF file nor a folder with a config.json.")
    return read_hf_config(path)


def load_model(
    path: Path, config: PretrainedConfig, dtype: torch.dtype, packed: bool = True
) -> nn.Module:
    """`packed`: keep a GGUF file's quantized matrices in their block format (`dtype` is then
    the activations' dtype); False dequantizes every weight to `dtype`."""
    if is_gguf_file(path):
        from impasto.loader.gguf_loader import iter_gguf_weights
        from impasto.models.registry import get_model_class

        model_cls = get_model_class(list(config.architectures or []))
        # Built directly in `dtype`: its torch.empty parameters are never touched until loaded
        # (a cast would read, and so commit, a float32 copy of the whole model first).
        with default_dtype(dtype):
            model = model_cls(config)
        model.load_weights(iter_gguf_weights(path, dtype, packed=packed))
        return model.eval()
    from impasto.loader.hf import load_hf_model

    model, _ = load_hf_model(path, dtype=dtype)
    return model.eval()
