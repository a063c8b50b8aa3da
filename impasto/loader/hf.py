"""Load an HF checkpoint folder (config.json + *.safetensors) into an impasto model.

Importing this module is cheap (the GGUF path imports `default_dtype`): transformers'
`AutoConfig`, which imports `transformers.models`, is imported by `read_hf_config` only.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn
from transformers import PretrainedConfig

from impasto.config.block_diffusion import MODEL_TYPES
from impasto.models.registry import get_model_class


def read_hf_config(folder: str | Path) -> PretrainedConfig:
    """The folder's config.json as a transformers config. Block-diffusion checkpoints whose
    upstream code is custom (SDAR, Fast-dLLM v2, dllm's A2D) are read as the config of their
    body (Qwen3 / Qwen2 / Llama), their own keys (block size, mask id) kept as attributes:
    no remote code is ever run."""
    from transformers import AutoConfig  # imports transformers.models: HF folders only

    folder = Path(folder)
    data = json.loads((folder / "config.json").read_text())
    body = MODEL_TYPES.get(str(data.get("model_type", "")).lower())
    if body is None:
        return AutoConfig.from_pretrained(str(folder), local_files_only=True)
    data = {k: v for k, v in data.items() if k not in ("model_type", "auto_map")}
    return AutoConfig.for_model(body, **data)


def safetensors_files(folder: str | Path) -> list[Path]:
    """The checkpoint's shards: those named in model.safetensors.index.json, else every file."""
    folder = Path(folder)
    index = folder / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = [folder / name for name in sorted(set(weight_map.values()))]
    else:
        files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {folder}")
    missing = [str(f) for f in files if not f.exists()]
    if missing:
        raise FileNotFoundError(f"checkpoint shards listed in the index are missing: {missing}")
    return files


def iter_safetensors(folder: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF parameter name, tensor) for every tensor of every shard, one at a time."""
    for path in safetensors_files(folder):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                yield name, f.get_tensor(name)


@contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def load_hf_model(
    path: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
) -> tuple[nn.Module, PretrainedConfig]:
    """Build the registered model for `config.architectures` and load its weights (strict).

    Only local folders are accepted: nothing is ever fetched from a model hub.
    """
    folder = Path(path)
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"{folder} is not a model folder (no config.json)")
    config = read_hf_config(folder)
    model_cls = get_model_class(list(config.architectures or []))
    # Parameters are created empty, directly in the target dtype and device (no init pass).
    with torch.device(device), default_dtype(dtype):
        model = model_cls(config)
    model.load_weights(iter_safetensors(folder))
    return model.eval(), config
