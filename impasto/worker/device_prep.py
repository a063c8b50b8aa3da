"""Prepare a loaded model for its device: pack weights, then point layers at the CPU kernels.

`impasto.kernels` only builds the ops, and layers only expose typed hooks
(`impasto.models.layers.device_hooks`); this module walks a model and calls them.

Order matters: weights are packed for oneDNN first (where the CPU supports it), so packed
layers keep oneDNN and the others get the kernels' GEMM; kernels go to children before their
parents, so a module spanning several layers (a Llama decoder stack) sees its layers set up.
Both are no-ops outside bf16 on CPU.
"""

from __future__ import annotations

from typing import TypeVar

from torch import nn

from impasto import kernels
from impasto.models.layers.device_hooks import (
    PacksWeights,
    Reproducible,
    UsesKernels,
    UsesPackedKernels,
)
from impasto.models.layers.quantized import PackedWeight


def prepack_linear_weights(model: nn.Module) -> int:
    """Pack every packable layer of `model` (oneDNN, packed.py); returns a count. Idempotent."""
    return sum(m.pack_weights() for m in model.modules() if isinstance(m, PacksWeights))


def install_kernels(model: nn.Module) -> int:
    """Point the layers of `model` that use the kernels at them; returns how many took them
    (0: not wanted, i.e. neither a bf16 CPU model nor packed GGUF weights on CPU, or the
    kernels are unavailable). Builds the kernel library if needed.

    Packed GGUF weights take the kernels' packed matmul whatever the activation dtype; the
    other layer kernels serve bf16 models only (float32 keeps the eager reference path)."""
    param = next(model.parameters(), None)
    if param is None:
        return 0
    packed = any(isinstance(m, PackedWeight) and m.segment_0.device.type == "cpu"
                 for m in model.modules())  # fmt: skip
    dense = kernels.wanted(param.dtype, param.device)
    if not (dense or (packed and kernels.enabled())):
        return 0
    ops = kernels.load()
    if ops is None:
        return 0
    # Reversed pre-order: every module comes after all of its descendants.
    modules = list(reversed(list(model.modules())))
    count = sum(m.use_packed_kernels(ops) for m in modules if isinstance(m, UsesPackedKernels))
    if dense:
        count += sum(m.use_kernels(ops) for m in modules if isinstance(m, UsesKernels))
    if packed:  # 8-bit activations turn last-bit differences into visible ones: see Reproducible
        count += sum(m.make_reproducible() for m in modules if isinstance(m, Reproducible))
    return count


M = TypeVar("M", bound=nn.Module)


def prepare_for_device(model: M) -> M:
    """CPU bf16 only (a no-op elsewhere): pack linear weights for oneDNN where the CPU supports
    it, then point the remaining layers at the fused kernels."""
    prepack_linear_weights(model)
    install_kernels(model)
    return model
