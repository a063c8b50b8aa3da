"""Where a model's generation defaults come from (`config/generation.py` says what they are):
an HF folder's `generation_config.json`, a GGUF file's `general.sampling.*` metadata, or the
model-card recommendation of a model impasto downloads by name."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from impasto.config import generation
from impasto.loader.gguf_loader import gguf_metadata, open_gguf
from impasto.loader.packaged_models import packaged_model_of
from impasto.loader.tokenizer import is_gguf_file


def model_generation_defaults(path: Path, mode: str) -> dict[str, Any]:
    """The defaults for `generation_config=mode` ("auto", "vllm" or a folder) of the model
    at `path` (a resolved folder or GGUF file)."""
    if mode == "vllm":
        return {}
    if mode != "auto":
        return generation.read_folder(mode, required=True)
    if not is_gguf_file(path):
        return generation.read_folder(path)
    reader = open_gguf(path)
    found = {
        field: value
        for key, field in generation.GGUF_KEYS.items()
        if (value := gguf_metadata(reader, key)) is not None
    }
    if found:
        return found
    packaged = packaged_model_of(path)
    return generation.from_hf(dict(packaged.generation_defaults)) if packaged else {}
