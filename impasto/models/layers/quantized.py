"""Packed GGML weights: linear layers, embeddings and LM heads that keep GGUF's block format.

A GGUF file's quantized matrices stay as they are in the file (each row of a [O, I] matrix is
I / block_elems GGML blocks); nothing builds a full-precision copy. Decode on a CPU is bound by
the bytes of weights it reads, so this is 3-4x fewer bytes per token than dequantized bf16.

- `QuantizedTensor` is what the loader hands to a parameter's `weight_loader` in place of a
  dense tensor: one tensor as stored (type, logical [rows, cols] shape, uint8 blocks).
- `PackedWeight` is what a layer keeps in place of its `weight` parameter: the row segments of
  its (possibly fused) matrix, each of one GGML type (a fused q/k/v projection of a Q4_K_M file
  mixes Q4_K and Q6_K rows). Segments are kept separate, not concatenated, so that they can
  stay views of the mapped file (no copy: the load's peak memory stays near the file size).
- `packed_linear` / `packed_embedding` compute with it: the kernels' integer-dot matmul
  (`torch.ops.impasto.quant_linear`, see impasto/kernels/quant_ops.cpp) when device preparation
  installed them, else the eager path of `ggml_blocks` (dequantize a chunk of rows + matmul).
  float32 layers take the kernels' float matmul instead (`quant_linear_float`, quant_float.cpp:
  exact dequantization, float32 activations), so float32 stays the faithful dtype on packed
  weights as on dense ones.

When the kernels are installed, each segment of a 16-bit layer whose type has interleaved
kernels (and whose rows come in whole groups of 8) is also repacked once into that layout
(`use_kernel_layout`, see impasto/kernels/quant_x8.cpp: 8 rows' blocks interleaved, the same
bytes rearranged), which the matmul then reads; the GGML-layout segments stay for embedding
lookups, the eager path and float32 layers.

Invariants: block tensors are never written (they may be read-only views of the file); a
PackedWeight's segments cover its rows in order, and so do its kernel segments; the output dtype
is the input's (bf16 or fp32 activations, whatever the weights' type).
"""

from __future__ import annotations

import ctypes
import mmap
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from impasto.models.layers.ggml_blocks import (
    BLOCK_SHAPE,
    GGMLType,
    dequantize_embedding,
    dequantize_linear,
    dequantize_rows,
)

PACKABLE_TYPES = frozenset(int(t) for t in BLOCK_SHAPE)
X8_FLAG = 1 << 8  # a kernel segment's type id in the interleaved layout: GGML's id | X8_FLAG


@dataclass(frozen=True)
class QuantizedTensor:
    """One packed matrix as loaded: `blocks` uint8 [rows, row_bytes] in GGML's layout."""

    qtype: int
    shape: tuple[int, int]  # logical (rows, cols)
    blocks: torch.Tensor
    mapped: bool = False  # blocks view a read-only file mapping: pages can be dropped, re-read

    def __post_init__(self) -> None:
        elems, nbytes = BLOCK_SHAPE[GGMLType(self.qtype)]
        rows, cols = self.shape
        if cols % elems or tuple(self.blocks.shape) != (rows, cols // elems * nbytes):
            raise ValueError(
                f"packed {GGMLType(self.qtype).name} tensor of shape {self.shape} cannot have "
                f"blocks of shape {tuple(self.blocks.shape)}"
            )

    def narrow(self, start: int, size: int) -> QuantizedTensor:
        """Rows [start, start + size) (a view)."""
        blocks = self.blocks[start : start + size]
        return QuantizedTensor(self.qtype, (size, self.shape[1]), blocks, self.mapped)

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        return dequantize_rows(self.blocks, self.qtype, self.shape[1], dtype)


def release_pages(view: torch.Tensor) -> None:
    """Drop the resident pages under `view`, a tensor over a read-only file mapping (the
    kernel re-reads them from the file if they are touched again, e.g. by embedding lookups),
    so a repacked weight does not count twice in the process's memory. Whole pages inside the
    view only; a no-op where madvise is unavailable."""
    if sys.platform != "linux" or view.numel() == 0:
        return
    page = mmap.PAGESIZE
    start = view.data_ptr()
    lo, hi = -(-start // page) * page, (start + view.numel() * view.element_size()) // page * page
    if hi > lo:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), mmap.MADV_DONTNEED)


class PackedWeight(nn.Module):
    """A [rows, cols] weight as row segments of packed blocks (buffers, so `.to()` moves them).

    `dtype` is the layer's compute dtype (what a dense weight would have had): embedding
    lookups produce it."""

    def __init__(self, parts: Sequence[QuantizedTensor], dtype: torch.dtype) -> None:
        super().__init__()
        if not parts or len({p.shape[1] for p in parts}) != 1:
            raise ValueError("a packed weight needs segments with one column count")
        self.qtypes = [p.qtype for p in parts]
        self.cols = parts[0].shape[1]
        self.rows = sum(p.shape[0] for p in parts)
        self.dtype = dtype
        for i, p in enumerate(parts):
            self.register_buffer(f"segment_{i}", p.blocks, persistent=False)
        # what the kernels' matmul reads: segment i, or its interleaved repacking (type | X8)
        self.kernel_qtypes = list(self.qtypes)
        self._kernel_names = [f"segment_{i}" for i in range(len(parts))]
        self._mapped = [p.mapped for p in parts]

    def use_kernel_layout(self, ops: Any) -> None:
        """Repack (once) every segment the kernels have an interleaved layout for."""
        for i, (blocks, qtype) in enumerate(zip(self.blocks, self.qtypes, strict=True)):
            if (
                self.kernel_qtypes[i] != qtype
                or blocks.shape[0] % 8
                or not ops.quant_repackable(qtype)
            ):
                continue
            self.register_buffer(
                f"x8_segment_{i}", ops.quant_repack(blocks, qtype), persistent=False
            )
            self._kernel_names[i] = f"x8_segment_{i}"
            self.kernel_qtypes[i] = qtype | X8_FLAG
            if self._mapped[i]:  # read once to repack: the file's pages need not stay resident
                release_pages(blocks)

    def first_rows(self, n: int) -> PackedWeight:
        """Rows [0, n) as a new weight of views of this one's segments (nothing copied).
        Before `use_kernel_layout` only: the interleaved layout is derived from the segments."""
        if not 0 < n <= self.rows:
            raise ValueError(f"first_rows({n}) of a weight with {self.rows} rows")
        if self.kernel_qtypes != self.qtypes:
            raise ValueError("first_rows after use_kernel_layout")
        parts, start = [], 0
        for blocks, qtype, mapped in zip(self.blocks, self.qtypes, self._mapped, strict=True):
            take = min(blocks.shape[0], n - start)
            if take <= 0:
                break
            parts.append(QuantizedTensor(qtype, (take, self.cols), blocks[:take], mapped))
            start += take
        return PackedWeight(parts, self.dtype)

    @property
    def blocks(self) -> list[torch.Tensor]:
        return [getattr(self, f"segment_{i}") for i in range(len(self.qtypes))]

    @property
    def kernel_blocks(self) -> list[torch.Tensor]:
        return [getattr(self, name) for name in self._kernel_names]

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.rows, self.cols))

    @property
    def nbytes(self) -> int:
        return sum(b.numel() for b in self.blocks)

    def extra_repr(self) -> str:
        types = ", ".join(GGMLType(t).name for t in self.qtypes)
        return f"rows={self.rows}, cols={self.cols}, types=[{types}]"


def packed_linear_eager(
    x: torch.Tensor, weight: PackedWeight, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """y = x W^T (+ b) by dequantizing chunks of rows (no compiler needed)."""
    parts = [
        dequantize_linear(x, blocks, qtype, weight.cols)
        for blocks, qtype in zip(weight.blocks, weight.qtypes, strict=True)
    ]
    y = parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)
    return y if bias is None else y + bias


class KernelPackedLinear:
    """The kernels' packed matmul as a `LinearFn` (ops: `impasto.kernels.ops()`); the decoder
    stack recognises layers computing with it."""

    def __init__(self, ops: Any) -> None:
        self.quant_linear = ops.quant_linear

    def __call__(
        self, x: torch.Tensor, weight: PackedWeight, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        return self.quant_linear(x, weight.kernel_blocks, weight.kernel_qtypes, bias)


class KernelFloatPackedLinear:
    """The kernels' float32-activation matmul on packed weights (`quant_linear_float`): the
    `LinearFn` of float32 models, whose activations are never rounded to 8 bits."""

    def __init__(self, ops: Any) -> None:
        self.quant_linear_float = ops.quant_linear_float

    def __call__(
        self, x: torch.Tensor, weight: PackedWeight, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        return self.quant_linear_float(x, weight.blocks, weight.qtypes, bias)


def kernel_linear(ops: Any, weight: PackedWeight) -> KernelPackedLinear | KernelFloatPackedLinear:
    """The kernels' matmul for a layer holding `weight`, by the layer's dtype: float32 keeps its
    activations in float32 on the file's layout (the faithful path: what the dequantized model
    computes); 16-bit dtypes round them to 8-bit blocks for integer dot products (the fast
    path, llama.cpp's arithmetic), on the interleaved layout, repacked here once."""
    if weight.dtype == torch.float32:
        return KernelFloatPackedLinear(ops)
    weight.use_kernel_layout(ops)
    return KernelPackedLinear(ops)


def packed_embedding(ids: torch.Tensor, weight: PackedWeight, ops: Any | None) -> torch.Tensor:
    """[T] token ids -> [T, cols] rows of the (single-segment) packed table, in weight.dtype."""
    (blocks,), (qtype,) = weight.blocks, weight.qtypes
    if ops is not None and weight.dtype in (torch.float32, torch.bfloat16):
        return ops.quant_embedding(ids, blocks, qtype, weight.cols, weight.dtype)
    return dequantize_embedding(ids, blocks, qtype, weight.cols, weight.dtype)
