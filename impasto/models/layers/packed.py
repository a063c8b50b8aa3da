"""CPU weight prepacking: bf16 linear weights reordered once into oneDNN's blocked layout.

PyTorch's plain bf16 `F.linear` streams weights at roughly half the memory bandwidth for the
skinny activations of decode (1-16 rows); a weight reordered once for oneDNN is read at close to
the roofline, with bit-identical results (both accumulate in float32 over the same blocks;
`tests/models/test_packed_weights.py` checks exact equality). Only bf16 on CPU is packed:
float32 goes through MKL already and stays the reference path for exactness tests.

After packing, a layer's `weight` parameter holds the packed (`torch._mkldnn` layout) tensor
and its `linear` attribute is `packed_linear`; nothing else reads packed weights.
`IMPASTO_CPU_PACKED_WEIGHTS=0` turns packing off (benchmarks compare both paths in one run).

`SwappableLinear` is the layers' side of it: the hooks (`device_hooks.py`) that pack a layer's
weight or point it at the kernels' bf16 GEMM, or, for a packed GGUF weight (`quantized.py`,
which oneDNN never touches), at the kernels' packed matmul. Invariant: a layer's matmul
is swapped at most once, away from `plain_linear`; oneDNN-packed layers keep oneDNN.
"""

from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F
from torch import nn

from impasto.models.layers.device_hooks import FusedOps, LinearFn
from impasto.models.layers.quantized import PackedWeight, kernel_linear


def can_pack(weight: torch.Tensor) -> bool:
    return (
        os.environ.get("IMPASTO_CPU_PACKED_WEIGHTS", "1") != "0"
        and weight.device.type == "cpu"
        and weight.dtype == torch.bfloat16
        and weight.dim() == 2
        and not weight.is_mkldnn
        and cpu_supports_packing()
    )


@functools.cache
def cpu_supports_packing() -> bool:
    """oneDNN packs bf16 weights only on CPUs with native bf16 conversions (AVX-512 or
    AVX-NE-CONVERT); elsewhere the reorder raises, so probe once with a tiny weight."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        w = torch.ops.mkldnn._reorder_linear_weight(torch.ones(16, 16, dtype=torch.bfloat16), 1)
        packed_linear(torch.ones(1, 16, dtype=torch.bfloat16), w)
    except RuntimeError:
        return False
    return True


def pack(weight: torch.Tensor) -> nn.Parameter:
    # The batch-size hint (1) picks the layout tuned for decode; larger M still runs at least
    # as fast as the plain path (measured up to M=1024).
    packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), 1)
    return nn.Parameter(packed, requires_grad=False)


def packed_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


plain_linear = F.linear  # an alias, not a wrapper: no extra Python frame per call


class SwappableLinear:
    """Mixin of modules computing `self.linear(x, self.weight, ...)`: implements
    `PacksWeights` and `UsesKernels` by swapping `linear` (and, packed, `weight`)."""

    weight: torch.Tensor
    linear: LinearFn

    def pack_weights(self) -> bool:
        """Pack for oneDNN where the CPU supports it. A tied LM head gets its own packed copy;
        the embedding keeps the plain table it needs for lookups."""
        if isinstance(self.weight, PackedWeight) or self.linear is not plain_linear:
            return False
        if not can_pack(self.weight):
            return False
        self.weight = pack(self.weight)
        self.linear = packed_linear
        return True

    def use_kernels(self, ops: FusedOps) -> bool:
        """The skinny bf16 GEMM for plain bf16 weights: it streams the weights at close to the
        memory bandwidth where PyTorch's bf16 matmul reaches about half of it (and is slower
        still with more rows; docs/benchmarks.md). Packed layers keep oneDNN."""
        if isinstance(self.weight, PackedWeight) or self.linear is not plain_linear:
            return False
        if self.weight.dtype != torch.bfloat16:
            return False
        self.linear = ops.linear_bf16
        return True

    def use_packed_kernels(self, ops: FusedOps) -> bool:
        """The kernels' matmul for a packed GGUF weight: integer dot products on 8-bit
        activations for 16-bit layers (repacked to the interleaved layout once), float32
        activations on the file's layout for float32 layers."""
        if not isinstance(self.weight, PackedWeight):
            return False
        self.linear = kernel_linear(ops, self.weight)
        return True
