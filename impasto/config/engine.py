"""The resolved configuration of one engine: every part, validated, in one frozen object."""

from __future__ import annotations

from dataclasses import dataclass

from impasto.config.diffusion import DiffusionConfig
from impasto.config.model import ModelConfig
from impasto.config.observability import ObservabilityConfig
from impasto.config.parallel import ParallelConfig
from impasto.config.scheduler import SchedulerConfig
from impasto.config.speculative import SpeculativeConfig


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig
    scheduler: SchedulerConfig
    parallel: ParallelConfig
    observability: ObservabilityConfig
    speculative: SpeculativeConfig | None = None  # AR models only
    diffusion: DiffusionConfig | None = None  # diffusion models only
