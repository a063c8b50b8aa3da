"""The packed GGML matmul and lookup (kernels/quant_ops.cpp, quant_dequant.cpp) against the
`gguf` package's dequantization followed by a float64 matmul.

Tolerance, from the arithmetic: the weights are exact (integers times their block scales), the
integer dot products are exact, so the one approximation is the activations' rounding to 8 bits
per block: q_i = round(x_i / d) with d = max|x over the block| / 127, so |x_i - d q_i| <= d / 2.
The 32-blocks types keep d as a half float d' (as llama.cpp does), which adds at most
127 |d - d'| <= 127 (2^-11 d + 2^-25) (relative rounding of a normal half, absolute of a
subnormal one), and their mins (Q4_1 / Q5_1) meet sum(x) as half(d * sum q), off from
d' * sum q by at most 2 * 32 * 127 * (2^-11 d + 2^-25). A row's error is thus at most the sum
over blocks of that step times sum |w_i| over the block (plus |min| times the sum's rounding),
plus float32 accumulation (relative ~1e-6 of sum |w_i x_i| over a few thousand terms; 1e-5
allowed). The bound is computed per output.

Beyond the bound, the activations are rounded exactly as llama.cpp rounds them (its Q8_0 / Q8_1
/ Q8_K blocks): a numpy reference of that rounding gives the kernel's result to float32
accumulation (test_activations_round_as_llamacpp).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize

from impasto import kernels
from impasto.models.layers.quantized import (
    X8_FLAG,
    KernelPackedLinear,
    PackedWeight,
    QuantizedTensor,
    packed_linear_eager,
    release_pages,
)

HAVE_COMPILER = shutil.which(os.environ.get("CXX", "c++")) is not None
pytestmark = pytest.mark.skipif(not HAVE_COMPILER, reason="no C++ compiler for the CPU kernels")

TYPES = [Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K]
# (weight rows, columns in blocks of 256, activation rows): GEMV, small and large batches,
# rows not a multiple of the 4- to 6-row passes, more rows than the 64-row tile, odd row counts.
SHAPES = [(64, 2, 1), (37, 3, 2), (33, 1, 7), (130, 4, 70), (5, 1, 129)]


@pytest.fixture(scope="module")
def ops():
    loaded = kernels.load()
    if loaded is None:
        pytest.skip("kernels unavailable")
    return loaded


def random_blocks(qtype: Q, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Random but valid blocks: every quant bit pattern (Q8_0's -128 included), finite half
    scales of either sign."""
    rng = np.random.default_rng(seed)
    elems, nbytes = GGML_QUANT_SIZES[qtype]
    nb = cols // elems
    raw = rng.integers(0, 256, size=(rows, nb, nbytes), dtype=np.uint8)
    halves = ((rng.random((rows, nb, 2)) - 0.5) * 0.02).astype(np.float16).view(np.uint8)
    if qtype == Q.Q6_K:  # d is the block's last field
        raw[..., 208:210] = halves[..., 0:2]
    elif qtype in (Q.Q4_1, Q.Q5_1, Q.Q4_K, Q.Q5_K):  # d and m / dmin first
        raw[..., 0:4] = halves.reshape(rows, nb, 4)
    else:  # d first
        raw[..., 0:2] = halves[..., 0:2]
    return raw.reshape(rows, nb * nbytes)


def block_mins(blocks: np.ndarray, qtype: Q) -> np.ndarray | None:
    """[O, nb] |min| of each block of Q4_1 / Q5_1 weights (their bytes 2-3); None otherwise."""
    if qtype not in (Q.Q4_1, Q.Q5_1):
        return None
    nbytes = GGML_QUANT_SIZES[qtype][1]
    raw = np.ascontiguousarray(blocks.reshape(blocks.shape[0], -1, nbytes)[..., 2:4])
    return np.abs(raw.view(np.float16)[..., 0].astype(np.float64))


HALF_REL, HALF_ABS = 2.0**-11, 2.0**-25  # a half float's rounding: relative, subnormal


def error_bound(x: np.ndarray, w: np.ndarray, elems: int, mins=None) -> np.ndarray:
    """[T, O] bound on |kernel - exact| (see the module docstring)."""
    t, n = x.shape
    act = 256 if elems == 256 else 32  # activation block = the weight's block family
    d = np.abs(x).reshape(t, n // act, act).max(-1) / 127  # [T, nb]
    scale_err = 0.0 if act == 256 else 127 * (HALF_REL * d + HALF_ABS)
    step = d / 2 + scale_err  # [T, nb]
    wabs = np.abs(w).reshape(w.shape[0], n // act, act).sum(-1)  # [O, nb]
    rounding = step @ wabs.T
    if mins is not None:
        rounding = rounding + (2 * 32 * 127 * (HALF_REL * d + HALF_ABS)) @ mins.T
    return rounding * 1.001 + 1e-5 * (np.abs(x) @ np.abs(w).T) + 1e-30


def llamacpp_matmul(x: np.ndarray, w: np.ndarray, blocks: np.ndarray, qtype: Q) -> np.ndarray:
    """[T, O] float64: x @ w.T with x rounded to 8 bits per block as llama.cpp rounds it (Q8_0
    / Q8_1 for the 32-blocks types, Q8_K for the K-quants), in float32 like llama.cpp."""
    t, n = x.shape
    act = GGML_QUANT_SIZES[qtype][0]
    xb = x.astype(np.float32).reshape(t, n // act, act)
    amax = np.abs(xb).max(-1)
    with np.errstate(divide="ignore"):
        inv = np.where(amax > 0, np.float32(127) / amax, np.float32(0)).astype(np.float32)
    q = np.rint(xb * inv[..., None])  # float32 product, ties to even
    if act == 256:
        d = np.where(amax > 0, np.float32(1) / inv, np.float32(0)).astype(np.float64)
    else:
        d32 = (amax / np.float32(127)).astype(np.float32)
        d = d32.astype(np.float16).astype(np.float64)
    xq = (d[..., None] * q).reshape(t, n)  # [T, n]
    y = xq @ w.T
    mins = block_mins(blocks, qtype)
    if mins is not None:  # the mins meet Q8_1's s = half(d * sum q), not sum(d' q)
        qsum = q.sum(-1).astype(np.float32)
        s = (d32 * qsum).astype(np.float16).astype(np.float64)  # [T, nb]
        nbytes = GGML_QUANT_SIZES[qtype][1]
        raw = np.ascontiguousarray(blocks.reshape(blocks.shape[0], -1, nbytes)[..., 2:4])
        m = raw.view(np.float16)[..., 0].astype(np.float64)  # [O, nb]
        y = y + (s - d * qsum) @ m.T
    return y


LAYOUTS = ["rows", "x8"]  # GGML's row layout; rows interleaved by 8 (quant_x8.cpp)
# and the float kernel on GGML's rows (quant_float.cpp, float32 activations), for the tests of
# properties every path shares
ALL_PATHS = [*LAYOUTS, "float"]


def rows_for(layout: str, rows: int) -> int:
    """The interleaved layout takes whole groups of 8 rows."""
    return -(-rows // 8) * 8 if layout == "x8" else rows


def kernel_segment(ops, blocks: np.ndarray, qtype: Q, layout: str) -> tuple[torch.Tensor, int]:
    """What quant_linear takes for one segment in `layout` (types without interleaved
    kernels, and row counts that are not whole groups of 8, stay in rows)."""
    t = torch.from_numpy(blocks)
    if layout == "x8" and ops.quant_repackable(int(qtype)) and blocks.shape[0] % 8 == 0:
        return ops.quant_repack(t, int(qtype)), int(qtype) | X8_FLAG
    return t, int(qtype)


def run(ops, x: torch.Tensor, blocks: list[np.ndarray], types: list[Q], bias=None, layout="rows"):
    segs = [kernel_segment(ops, b, t, layout) for b, t in zip(blocks, types, strict=True)]
    op = ops.quant_linear_float if layout == "float" else ops.quant_linear
    return op(x, [b for b, _ in segs], [t for _, t in segs], bias)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("qtype", TYPES, ids=[t.name for t in TYPES])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_matmul_within_activation_rounding(ops, qtype, shape, layout):
    rows, kblocks, t = shape
    rows = rows_for(layout, rows)
    cols = 256 * kblocks
    blocks = random_blocks(qtype, rows, cols, seed=rows + t)
    w = dequantize(blocks, qtype).reshape(rows, cols).astype(np.float64)
    x = torch.randn(t, cols, generator=torch.Generator().manual_seed(t))
    y = run(ops, x, [blocks], [qtype], layout=layout).double().numpy()
    exact = x.double().numpy() @ w.T
    mins = block_mins(blocks, qtype)
    bound = error_bound(x.double().numpy(), w, GGML_QUANT_SIZES[qtype][0], mins)
    assert np.all(np.abs(y - exact) <= bound), np.max(np.abs(y - exact) / bound)
    # and the bound is not vacuous: the error is a visible fraction of it somewhere
    assert np.max(np.abs(y - exact) / bound) > 1e-3


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("qtype", TYPES, ids=[t.name for t in TYPES])
def test_activations_round_as_llamacpp(ops, qtype, layout):
    """The kernel computes what llama.cpp computes on the same blocks: with the activations
    rounded by llama.cpp's rules the result agrees to float32 accumulation, far inside the
    rounding bound (one q off by one in a row moves it by d |w_i|, ~100x this tolerance)."""
    rows, cols, t = rows_for(layout, 24), 1024, 7
    blocks = random_blocks(qtype, rows, cols, seed=11)
    w = dequantize(blocks, qtype).reshape(rows, cols).astype(np.float64)
    x = torch.randn(t, cols, generator=torch.Generator().manual_seed(5)) * 3
    y = run(ops, x, [blocks], [qtype], layout=layout).double().numpy()
    ref = llamacpp_matmul(x.numpy(), w, blocks, qtype)
    tol = 2e-6 * (np.abs(x.double().numpy()) @ np.abs(w).T) + 1e-30
    assert np.all(np.abs(y - ref) <= tol), np.max(np.abs(y - ref) / tol)
    # and it is not merely the float result: that one differs by far more than the tolerance
    exact = x.double().numpy() @ w.T
    assert np.max(np.abs(exact - ref) / tol) > 10


@pytest.mark.parametrize("layout", ALL_PATHS)
@pytest.mark.parametrize("qtype", TYPES, ids=[t.name for t in TYPES])
def test_rows_do_not_depend_on_the_batch(ops, qtype, layout):
    """Each row's result is the same bits alone, in any batch, at any position of it."""
    blocks = random_blocks(qtype, rows_for(layout, 70), 512, seed=3)
    x = torch.randn(67, 512, generator=torch.Generator().manual_seed(1))
    full = run(ops, x, [blocks], [qtype], layout=layout)
    for idx in ([0], [66], [5, 6, 7], list(range(3, 67, 2))):
        assert torch.equal(run(ops, x[idx], [blocks], [qtype], layout=layout), full[idx])
    shuffled = torch.randperm(67, generator=torch.Generator().manual_seed(2))
    assert torch.equal(run(ops, x[shuffled], [blocks], [qtype], layout=layout), full[shuffled])


@pytest.mark.parametrize("qtype", TYPES, ids=[t.name for t in TYPES])
def test_interleaved_layout_agrees_with_rows(ops, qtype):
    """The two layouts do the same integer sums and group the float terms differently:
    equal to float rounding. Types without interleaved kernels are refused by the repack."""
    blocks = random_blocks(qtype, 48, 768, seed=9)
    x = torch.randn(9, 768, generator=torch.Generator().manual_seed(3))
    if not ops.quant_repackable(int(qtype)):
        with pytest.raises(RuntimeError, match="no interleaved kernels"):
            ops.quant_repack(torch.from_numpy(blocks), int(qtype))
        return
    rows, x8 = run(ops, x, [blocks], [qtype]), run(ops, x, [blocks], [qtype], layout="x8")
    assert torch.allclose(rows, x8, rtol=1e-5, atol=1e-6 * rows.abs().max().item())
    assert not torch.equal(rows, x8)  # it is a different kernel
    packed = ops.quant_repack(torch.from_numpy(blocks), int(qtype))
    assert packed.shape[0] == 6 and packed.numel() >= blocks.size  # rearranged, nothing dropped
    with pytest.raises(RuntimeError, match="multiple of 8"):
        ops.quant_repack(torch.from_numpy(blocks[:12]), int(qtype))


@pytest.mark.parametrize("layout", ALL_PATHS)
def test_segments_bias_and_bf16(ops, layout):
    """Row segments of mixed families (a Q4_K_M q/k/v projection mixes types) give the
    concatenation of each segment alone; the bias is added in float before one rounding;
    bf16 activations are widened exactly, so they match the float32 call on the same values."""
    cols = 512
    parts = [(Q.Q4_K, 48), (Q.Q6_K, 16), (Q.Q8_0, 16), (Q.Q5_0, 3)]
    blocks = [random_blocks(t, r, cols, seed=i) for i, (t, r) in enumerate(parts)]
    types = [t for t, _ in parts]
    x = torch.randn(5, cols, generator=torch.Generator().manual_seed(0)).bfloat16()
    alone = torch.cat(
        [run(ops, x.float(), [b], [t], layout=layout) for b, t in zip(blocks, types, strict=True)],
        dim=1,
    )
    assert torch.equal(run(ops, x.float(), blocks, types, layout=layout), alone)
    bias = torch.randn(alone.shape[1])
    assert torch.equal(run(ops, x.float(), blocks, types, bias, layout=layout), alone + bias)
    y16 = run(ops, x, blocks, types, bias.bfloat16(), layout=layout)
    assert y16.dtype == torch.bfloat16
    assert torch.equal(y16, (alone + bias.bfloat16().float()).bfloat16())
    # leading dims and empty inputs
    assert run(ops, x.float().view(5, 1, cols), blocks, types, layout=layout).shape == (
        5,
        1,
        alone.shape[1],
    )
    assert run(ops, x.float()[:0], blocks, types, layout=layout).shape == (0, alone.shape[1])


def test_shape_errors(ops):
    blocks = random_blocks(Q.Q4_K, 4, 512)
    with pytest.raises(RuntimeError, match="does not match the packed row"):
        run(ops, torch.randn(1, 256), [blocks], [Q.Q4_K])
    with pytest.raises(RuntimeError, match="unsupported GGML type"):
        ops.quant_linear(torch.randn(1, 512), [torch.from_numpy(blocks)], [int(Q.Q2_K)])


@pytest.mark.parametrize("qtype", TYPES, ids=[t.name for t in TYPES])
def test_embedding_rows_are_gguf_dequantization(ops, qtype):
    blocks = random_blocks(qtype, 40, 512, seed=5)
    table = torch.from_numpy(dequantize(blocks, qtype).reshape(40, 512))
    ids = torch.tensor([0, 39, 7, 7, 12])
    got = ops.quant_embedding(ids, torch.from_numpy(blocks), int(qtype), 512, torch.float32)
    assert torch.equal(got, table[ids])
    got16 = ops.quant_embedding(ids, torch.from_numpy(blocks), int(qtype), 512, torch.bfloat16)
    assert torch.equal(got16, table[ids].bfloat16())
    with pytest.raises(RuntimeError, match="out of range"):
        ops.quant_embedding(torch.tensor([40]), torch.from_numpy(blocks), int(qtype), 512,
                            torch.float32)  # fmt: skip


def test_eager_fallback_agrees(ops):
    """Without a compiler layers dequantize rows and matmul (quantized.py): the same numbers
    up to the activation rounding the kernel adds."""
    cols = 512
    parts = [(Q.Q4_K, 32), (Q.Q6_K, 8), (Q.Q5_0, 8)]
    tensors = [
        QuantizedTensor(int(t), (r, cols), torch.from_numpy(random_blocks(t, r, cols, seed=r)))
        for t, r in parts
    ]
    weight = PackedWeight(tensors, torch.float32)
    x = torch.randn(3, cols, generator=torch.Generator().manual_seed(4))
    eager = packed_linear_eager(x, weight)
    kernel = ops.quant_linear(x, weight.blocks, weight.qtypes)
    w = np.concatenate([t.dequantize(torch.float64).numpy() for t in tensors])
    exact = x.double().numpy() @ w.T
    assert np.allclose(eager.double().numpy(), exact, rtol=1e-5, atol=1e-5)
    bound = np.concatenate(
        [
            error_bound(
                x.double().numpy(),
                t.dequantize(torch.float64).numpy(),
                GGML_QUANT_SIZES[Q(t.qtype)][0],
                block_mins(t.blocks.numpy(), Q(t.qtype)),
            )  # fmt: skip
            for t in tensors
        ],
        axis=1,
    )
    assert np.all(np.abs(kernel.double().numpy() - exact) <= bound)


_ISA_SCRIPT = """
import json, sys, numpy as np, torch
sys.path.insert(0, {root!r})
from impasto import kernels
from tests.kernels.test_quant_ops import TYPES, random_blocks
ops = kernels.load()
x = torch.randn(13, 512, generator=torch.Generator().manual_seed(0))  # passes of 6 + 7 rows
out = {{"isa": ops.quant_isa()}}
for t in TYPES:
    blocks = torch.from_numpy(random_blocks(t, 16, 512))
    y = ops.quant_linear(x, [blocks], [int(t)])
    out[t.name] = y.numpy().view(np.int32).tolist()
    if ops.quant_repackable(int(t)):
        y = ops.quant_linear(x, [ops.quant_repack(blocks, int(t))], [int(t) | 256])
        out[t.name + "-x8"] = y.numpy().view(np.int32).tolist()
print(json.dumps(out))
"""


def _isa_outputs(isa: str) -> dict:
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, IMPASTO_CPU_ISA=isa)
    proc = subprocess.run(
        [sys.executable, "-c", _ISA_SCRIPT.format(root=root)],
        env=env, capture_output=True, text=True, timeout=600, check=True,
    )  # fmt: skip
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_avx2_build_gives_the_same_bits_as_the_native_one(ops):
    """On a CPU with VNNI the native build's dot products use it; a build limited to AVX2
    must give the same results bit for bit (the integer sums are exact on both)."""
    native, avx2 = _isa_outputs("native"), _isa_outputs("avx2")
    assert avx2["isa"] in ("avx2", "portable")
    if native["isa"] == avx2["isa"]:
        pytest.skip(f"this CPU has no wider instruction set than {avx2['isa']}")
    assert native.keys() == avx2.keys()
    for name in native.keys() - {"isa"}:
        assert native[name] == avx2[name], name


def test_packed_weight_kernel_layout(ops):
    """`use_kernel_layout` repacks the segments the interleaved kernels take (whole groups of 8
    rows, a supported type) and leaves the rest; the GGML-layout segments stay for embedding
    lookups; the matmul gives the same results to float rounding as on the row layout."""
    cols = 512
    parts = [(Q.Q4_K, 32), (Q.Q6_K, 12), (Q.Q5_K, 8), (Q.Q8_0, 8)]
    tensors = [
        QuantizedTensor(int(t), (r, cols), torch.from_numpy(random_blocks(t, r, cols, seed=r)))
        for t, r in parts
    ]
    weight = PackedWeight(tensors, torch.float32)
    x = torch.randn(3, cols, generator=torch.Generator().manual_seed(4))
    before = KernelPackedLinear(ops)(x, weight)
    weight.use_kernel_layout(ops)
    weight.use_kernel_layout(ops)  # once only
    assert weight.kernel_qtypes == [
        int(Q.Q4_K) | X8_FLAG,
        int(Q.Q6_K),
        int(Q.Q5_K),
        int(Q.Q8_0) | X8_FLAG,
    ]
    assert [b.data_ptr() for b in weight.blocks] == [t.blocks.data_ptr() for t in tensors]
    after = KernelPackedLinear(ops)(x, weight)
    assert torch.allclose(before, after, rtol=1e-5, atol=1e-6 * before.abs().max().item())


def test_released_pages_of_a_file_mapping_read_back_the_same(tmp_path):
    """A repacked segment's file pages are dropped (`release_pages`): the mapping stays valid
    and reads the file's bytes again (embedding lookups on a tied table still see them)."""
    data = np.random.default_rng(0).integers(0, 256, size=5 * 4096 + 123, dtype=np.uint8)
    path = tmp_path / "blocks.bin"
    data.tofile(path)
    view = torch.from_numpy(np.memmap(path, dtype=np.uint8, mode="r"))
    assert int(view.sum()) == int(data.sum())  # resident now
    release_pages(view[100:])
    assert np.array_equal(view.numpy(), data)
