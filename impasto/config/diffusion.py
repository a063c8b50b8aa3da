"""`diffusion_config`: canvas length, step cap and sampler settings of a diffusion LM.

Precedence (lowest first): built-in defaults (DiffusionGemma's), the checkpoint's
`generation_config.json`, then the `diffusion_config` engine argument (vLLM-style dict), e.g.
`LLM(model, diffusion_config={"max_denoising_steps": 16})`.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from impasto.errors import InvalidParameterError

_GENERATION_KEYS = (
    "max_denoising_steps",
    "t_min",
    "t_max",
    "stability_threshold",
    "confidence_threshold",
)


@dataclass(frozen=True)
class DiffusionConfig:
    canvas_length: int = 256
    max_denoising_steps: int = 48
    t_min: float = 0.4  # temperature at the last allowed step
    t_max: float = 0.8  # temperature at the first step
    entropy_bound: float = 0.1
    stability_threshold: int = 1  # steps the argmax canvas must stay unchanged
    confidence_threshold: float = 0.005  # mean entropy below which a stable canvas is done

    def __post_init__(self) -> None:
        def bad(name: str, why: str) -> InvalidParameterError:
            message = f"diffusion_config.{name} {why}, got {getattr(self, name)!r}."
            return InvalidParameterError("diffusion_config", message)

        for name in ("canvas_length", "max_denoising_steps"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise bad(name, "must be a positive integer")
        if not 0 <= self.t_min < self.t_max:
            raise bad("t_max", f"must be greater than t_min ({self.t_min}) >= 0")
        if self.t_min == 0:
            raise bad("t_min", "must be > 0 (the logits are divided by the temperature)")
        if self.entropy_bound <= 0:
            raise bad("entropy_bound", "must be > 0")
        if not isinstance(self.stability_threshold, int) or self.stability_threshold < 0:
            raise bad("stability_threshold", "must be an integer >= 0")
        if self.confidence_threshold <= 0:
            raise bad("confidence_threshold", "must be > 0")

    def temperature(self, step: int) -> float:
        """Linear schedule: t_max at step 0, t_min + (t_max - t_min) / N at step N - 1."""
        remaining = self.max_denoising_steps - step
        return self.t_min + (self.t_max - self.t_min) * remaining / self.max_denoising_steps

    @classmethod
    def resolve(
        cls, overrides: dict[str, Any] | None, hf_config: Any, model_path: Path | None
    ) -> DiffusionConfig:
        values: dict[str, Any] = {}
        canvas = getattr(hf_config, "canvas_length", None)
        if canvas:
            values["canvas_length"] = int(canvas)
        gen = model_path / "generation_config.json" if model_path is not None else None
        if gen is not None and gen.is_file():
            data = json.loads(gen.read_text())
            values.update({k: data[k] for k in _GENERATION_KEYS if data.get(k) is not None})
            bound = (data.get("sampler_config") or {}).get("entropy_bound")
            if bound is not None:
                values["entropy_bound"] = bound
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(overrides or {}) - names)
        if unknown:
            raise InvalidParameterError(
                "diffusion_config",
                f"unknown diffusion_config key(s) {unknown}; supported: {sorted(names)}",
            )
        values.update(overrides or {})
        return cls(**values)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
