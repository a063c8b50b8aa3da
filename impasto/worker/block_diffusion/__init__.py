"""Masked block diffusion execution: unmasking rules and the block runner."""

from impasto.worker.block_diffusion.runner import BlockState, MaskedBlockRunner
from impasto.worker.block_diffusion.unmasking import RULES, register_rule

__all__ = ["RULES", "BlockState", "MaskedBlockRunner", "register_rule"]
