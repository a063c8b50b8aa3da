"""Diffusion LM execution: the canvas sampler and the diffusion model runner."""

from impasto.worker.diffusion.runner import DiffusionModelRunner, DiffusionStats
from impasto.worker.diffusion.sampler import CanvasState, DiffusionSampler

__all__ = ["CanvasState", "DiffusionModelRunner", "DiffusionSampler", "DiffusionStats"]
