"""Shared building blocks for model definitions."""

from impasto.models.layers.attention import Attention
from impasto.models.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from impasto.models.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)
from impasto.models.layers.mlp import GatedMLP
from impasto.models.layers.norm import RMSNorm
from impasto.models.layers.rotary import RotaryEmbedding, rope_parameters

__all__ = [
    "Attention",
    "ColumnParallelLinear",
    "GatedMLP",
    "MergedColumnParallelLinear",
    "ParallelLMHead",
    "QKVParallelLinear",
    "RMSNorm",
    "ReplicatedLinear",
    "RotaryEmbedding",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "rope_parameters",
]
