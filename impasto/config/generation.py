"""Generation defaults: the sampling parameters a model's authors recommend, applied to the
fields a request leaves unset (vLLM's `--generation-config` and `--override-generation-config`).

Sources, by `generation_config` mode:
- "auto" (the default): the model folder's `generation_config.json`; for a GGUF file, its
  `general.sampling.*` metadata (llama.cpp's keys) or, for the models impasto downloads by name,
  the recommendation of their model card (`loader/packaged_models.py`);
- "vllm": none (impasto's own defaults: temperature 1.0, top-p 1.0, ...);
- a folder path: the `generation_config.json` in it.
`override_generation_config` (a dict) is laid over whichever of them, field by field.

Only the sampling keys vLLM reads are taken (`temperature`, `top_p`, `top_k`, `min_p`,
`repetition_penalty`, and `max_new_tokens` as the default `max_tokens`); the result is a dict
of `SamplingParams` field names, checked by `SamplingParams` itself where it is used.
Pure Python.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from impasto.errors import InvalidParameterError

MODES = ("auto", "vllm")
# generation_config.json key -> SamplingParams field
HF_KEYS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}
# GGUF `general.sampling.*` metadata key (llama.cpp) -> SamplingParams field
GGUF_KEYS = {
    "general.sampling.temp": "temperature",
    "general.sampling.top_p": "top_p",
    "general.sampling.top_k": "top_k",
    "general.sampling.min_p": "min_p",
    "general.sampling.penalty_repeat": "repetition_penalty",
}
FIELDS = frozenset(HF_KEYS.values())


def from_hf(data: Mapping[str, Any]) -> dict[str, Any]:
    """The sampling defaults of a `generation_config.json` (missing or null keys: none)."""
    return {field: data[key] for key, field in HF_KEYS.items() if data.get(key) is not None}


def read_folder(folder: str | Path, required: bool = False) -> dict[str, Any]:
    """The defaults of `folder/generation_config.json`; a missing file is an error only when
    the folder was named explicitly (`required`)."""
    file = Path(folder) / "generation_config.json"
    if not file.is_file():
        if required:
            raise InvalidParameterError(
                "generation_config", f"no generation_config.json in {str(folder)!r}."
            )
        return {}
    try:
        data = json.loads(file.read_text())
    except (OSError, ValueError) as e:
        raise InvalidParameterError("generation_config", f"cannot read {file.name}: {e}") from None
    return from_hf(data if isinstance(data, dict) else {})


def check_overrides(overrides: Mapping[str, Any] | None) -> dict[str, Any]:
    """`override_generation_config`: generation_config.json keys (or SamplingParams names)."""
    out: dict[str, Any] = {}
    for key, value in (overrides or {}).items():
        field = HF_KEYS.get(key, key)
        if field not in FIELDS:
            raise InvalidParameterError(
                "override_generation_config",
                f"override_generation_config: {key!r} is not one of {sorted(HF_KEYS)}.",
            )
        out[field] = value
    return out
