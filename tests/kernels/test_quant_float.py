"""The float32-activation matmul on packed GGML weights (kernels/quant_float.cpp) against the
`gguf` package's dequantization followed by a float64 matmul.

Tolerance, from the arithmetic: the dequantized weights are the gguf package's float32 values
bit for bit (tests/kernels/test_quant_ops.py checks the lookup that shares the code), and the
activations are not rounded, so the one approximation is float32 summation: each of dot's 8
lanes adds n / 8 products by fused multiply-add (one rounding of u = 2^-24 each), then three
additions join the lanes and the tail adds its products. To first order the error of an output
is at most (n / 8 + 3 + n % 8) u sum_i |x_i w_i| (1 % slack covers the higher orders), plus the
output's rounding, u |y| (twice that allowed): far tighter than the 8-bit activations' bound.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize

from impasto.models.layers.quantized import (
    X8_FLAG,
    KernelFloatPackedLinear,
    KernelPackedLinear,
    PackedWeight,
    QuantizedTensor,
    kernel_linear,
)
from tests.kernels.test_quant_ops import HAVE_COMPILER, SHAPES, TYPES, ops, random_blocks

pytestmark = pytest.mark.skipif(not HAVE_COMPILER, reason="no C++ compiler for the CPU kernels")
__all__ = ["ops"]  # the module-scoped fixture, shared with test_quant_ops

U = 2.0**-24


def float_bound(x: np.ndarray, w: np.ndarray, y: np.ndarray) -> np.ndarray:
    """[T, O] bound on |kernel - exact| (see the module docstring)."""
    n = x.shape[1]
    terms = n // 8 + 3 + n % 8
    return 1.01 * terms * U * (np.abs(x) @ np.abs(w).T) + 2 * U * np.abs(y) + 1e-30


def run(ops, x, blocks: list[np.ndarray], types: list[Q], bias=None) -> torch.Tensor:
    return ops.quant_linear_float(
        x, [torch.from_numpy(b) for b in blocks], [int(t) for t in types], bias
    )


@pytest.mark.parametrize("qtype", TYPES, ids=[t.name for t in TYPES])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_matmul_within_float32_summation(ops, qtype, shape):
    """GEMV, small and large batches, row counts that are not whole 4-row tiles, odd sizes."""
    rows, n_blocks256, t = shape
    cols = 256 * n_blocks256
    blocks = random_blocks(qtype, rows, cols, seed=rows + t)
    w = dequantize(blocks, qtype).astype(np.float64).reshape(rows, cols)
    x = torch.randn(t, cols, generator=torch.Generator().manual_seed(t))
    exact = x.double().numpy() @ w.T
    got = run(ops, x, [blocks], [qtype]).double().numpy()
    err = np.abs(got - exact)
    bound = float_bound(x.double().numpy(), w, exact)
    assert (err <= bound).all(), f"worst {float((err / bound).max()):.3f} of the bound"


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q6_K, Q.Q4_1, Q.Q8_0], ids=lambda t: t.name)
def test_weight_rows_do_not_depend_on_their_tile(ops, qtype):
    """Rows dequantize in 4-row tiles: any slice of the weight gives the same bits. (Batch
    invariance, segments, bias and bf16: test_quant_ops.py runs its tests on this path too.)"""
    blocks = random_blocks(qtype, 70, 512, seed=3)
    x = torch.randn(9, 512, generator=torch.Generator().manual_seed(1))
    full = run(ops, x, [blocks], [qtype])
    for lo, hi in ((0, 1), (3, 10), (65, 70)):
        assert torch.equal(run(ops, x, [blocks[lo:hi]], [qtype]), full[:, lo:hi])
    assert torch.equal(run(ops, x.t().contiguous().t(), [blocks], [qtype]), full)  # strided x


def test_errors(ops):
    blocks = random_blocks(Q.Q4_K, 8, 512)
    with pytest.raises(RuntimeError, match="does not match the packed row"):
        run(ops, torch.randn(1, 256), [blocks], [Q.Q4_K])
    with pytest.raises(RuntimeError, match="unsupported GGML type"):
        run(ops, torch.randn(1, 512), [blocks], [Q.Q2_K])
    repacked = ops.quant_repack(torch.from_numpy(blocks), int(Q.Q4_K))  # the interleaved layout
    with pytest.raises(RuntimeError, match="unsupported GGML type"):
        ops.quant_linear_float(torch.randn(1, 512), [repacked], [int(Q.Q4_K) | X8_FLAG])
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        run(ops, torch.randn(1, 512).half(), [blocks], [Q.Q4_K])


def test_layers_pick_their_matmul_by_dtype(ops):
    """A float32 layer computes on the file's layout with float activations (nothing
    repacked); a bf16 layer takes the 8-bit integer kernels on the interleaved layout."""
    cols = 512
    tensor = QuantizedTensor(
        int(Q.Q4_K), (16, cols), torch.from_numpy(random_blocks(Q.Q4_K, 16, cols))
    )
    f32, b16 = PackedWeight([tensor], torch.float32), PackedWeight([tensor], torch.bfloat16)
    f32_linear, b16_linear = kernel_linear(ops, f32), kernel_linear(ops, b16)
    assert isinstance(f32_linear, KernelFloatPackedLinear)
    assert isinstance(b16_linear, KernelPackedLinear)
    x = torch.randn(3, cols, generator=torch.Generator().manual_seed(5))
    w = torch.from_numpy(dequantize(tensor.blocks.numpy(), Q.Q4_K).reshape(16, cols))
    y = f32_linear(x, f32)
    assert f32.kernel_qtypes == [int(Q.Q4_K)]  # nothing repacked
    torch.testing.assert_close(y, x @ w.T, rtol=1e-5, atol=1e-5)
    assert b16.kernel_qtypes == [int(Q.Q4_K) | X8_FLAG]
    y8 = b16_linear(x.bfloat16(), b16).float()
    assert not torch.equal(y8, y.bfloat16().float())  # 8-bit activations: another result
    torch.testing.assert_close(y8, y, rtol=0.05, atol=0.05 * y.abs().max().item())
