"""Typed, frozen configuration, validated once at construction. Pure Python: nothing here
imports torch or any impasto package above it (the lint step enforces it).

`EngineArgs` is what users pass; the engine's setup resolves it against the checkpoint into an
`EngineConfig` (model, scheduler, parallel, observability, speculative, diffusion), which the
worker, model and engine layers read.
"""

from impasto.config.diffusion import DiffusionConfig
from impasto.config.engine import EngineConfig
from impasto.config.engine_args import DEFAULT_KV_CACHE_BYTES, EngineArgs
from impasto.config.model import ModelConfig
from impasto.config.observability import ObservabilityConfig
from impasto.config.parallel import ParallelConfig
from impasto.config.scheduler import SchedulerConfig
from impasto.config.speculative import SpeculativeConfig

__all__ = [
    "DEFAULT_KV_CACHE_BYTES",
    "DiffusionConfig",
    "EngineArgs",
    "EngineConfig",
    "ModelConfig",
    "ObservabilityConfig",
    "ParallelConfig",
    "SchedulerConfig",
    "SpeculativeConfig",
]
