"""Pure-torch GGML block dequantization against the `gguf` package's numpy reference.

`dequantize_rows` must be bit-identical to `gguf.quants.dequantize` (float32) for every
packable type. gguf can quantize only the 32-element types (its K-quant classes dequantize
only), so K-quant blocks are random bytes with finite fp16 scales: every bit pattern of the
quants and the packed 6-bit scales is a valid block, so random bytes cover the layouts better
than any quantizer would.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize, quantize

from impasto.models.layers import ggml_blocks
from impasto.models.layers.ggml_blocks import (
    BLOCK_SHAPE,
    GGMLType,
    dequantize_embedding,
    dequantize_linear,
    dequantize_rows,
    is_packable,
    row_bytes,
)

TYPES = list(GGMLType)
GGUF_QUANTIZABLE = [GGMLType.Q4_0, GGMLType.Q4_1, GGMLType.Q5_0, GGMLType.Q5_1, GGMLType.Q8_0]

# Byte offsets of the fp16 scales in each block (d, and dmin/m where the format has one),
# written from the GGML block structs independently of the module under test.
FP16_FIELDS = {
    GGMLType.Q4_0: (0,),
    GGMLType.Q4_1: (0, 2),
    GGMLType.Q5_0: (0,),
    GGMLType.Q5_1: (0, 2),
    GGMLType.Q8_0: (0,),
    GGMLType.Q4_K: (0, 2),
    GGMLType.Q5_K: (0, 2),
    GGMLType.Q6_K: (208,),
}


def random_blocks(
    qtype: GGMLType, rows: int, cols: int, seed: int, scales: str = "any"
) -> np.ndarray:
    """Valid packed rows uint8 [rows, row_bytes]: random bytes, then each fp16 scale set to a
    finite value: any finite bit pattern (`"any"`: signs, subnormals, up to 65504) or small
    normal values (`"small"`, for matmul tests whose products should stay moderate)."""
    rng = np.random.default_rng(seed)
    elems, nbytes = BLOCK_SHAPE[qtype]
    raw = rng.integers(0, 256, (rows, cols // elems, nbytes), dtype=np.uint8)
    for off in FP16_FIELDS[qtype]:
        if scales == "any":
            bits = rng.integers(0, 1 << 16, raw.shape[:2], dtype=np.uint16)
            inf_or_nan = (bits & 0x7C00) == 0x7C00
            bits = np.where(inf_or_nan, bits & 0xBFFF, bits)  # clear an exponent bit
            raw[..., off : off + 2] = bits[..., None].view(np.uint8)
        else:
            small = (rng.standard_normal(raw.shape[:2]) * 0.01).astype(np.float16)
            raw[..., off : off + 2] = small[..., None].view(np.uint8)
    return raw.reshape(rows, -1)


def reference(raw: np.ndarray, qtype: GGMLType) -> np.ndarray:
    return dequantize(np.ascontiguousarray(raw), Q(int(qtype)))


def assert_bits_equal(got: torch.Tensor, want: np.ndarray) -> None:
    assert got.dtype == torch.float32 and tuple(got.shape) == want.shape
    assert want.dtype == np.float32
    np.testing.assert_array_equal(got.numpy().view(np.uint32), want.view(np.uint32))


def test_type_table_is_ggmls():
    for t in GGMLType:
        assert int(Q[t.name]) == int(t)
        assert BLOCK_SHAPE[t] == gguf.GGML_QUANT_SIZES[Q[t.name]]
    assert set(BLOCK_SHAPE) == set(GGMLType)
    assert is_packable(12) and not is_packable(int(Q.Q2_K)) and not is_packable(int(Q.F16))


def test_row_bytes():
    assert row_bytes(GGMLType.Q4_0, 64) == 36
    assert row_bytes(GGMLType.Q8_0, 32) == 34
    assert row_bytes(GGMLType.Q4_K, 4864) == 19 * 144
    assert row_bytes(int(GGMLType.Q6_K), 512) == 420  # plain ints are accepted
    for qtype, cols in [
        (GGMLType.Q4_0, 48),
        (GGMLType.Q4_K, 896),  # 3.5 super-blocks
        (GGMLType.Q6_K, 128),
        (GGMLType.Q8_0, 0),
        (GGMLType.Q5_K, -256),
        (int(Q.Q2_K), 256),  # a GGML type that is not packable
    ]:
        with pytest.raises(ValueError):
            row_bytes(qtype, cols)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("rows", [1, 3, 64])
@pytest.mark.parametrize("n_blocks", [1, 3])
def test_random_blocks_are_bit_identical(qtype, rows, n_blocks):
    cols = n_blocks * BLOCK_SHAPE[qtype][0]
    raw = random_blocks(qtype, rows, cols, seed=rows * 10 + n_blocks)
    assert_bits_equal(dequantize_rows(torch.from_numpy(raw), qtype, cols), reference(raw, qtype))


@pytest.mark.parametrize("qtype", GGUF_QUANTIZABLE, ids=lambda t: t.name)
@pytest.mark.parametrize("rows", [1, 3, 64])
@pytest.mark.parametrize("n_blocks", [1, 5])
def test_gguf_quantized_data_is_bit_identical(qtype, rows, n_blocks):
    cols = n_blocks * BLOCK_SHAPE[qtype][0]
    x = np.random.default_rng(rows + n_blocks).standard_normal((rows, cols)).astype(np.float32)
    raw = quantize(x, Q(int(qtype)))
    assert raw.shape == (rows, row_bytes(qtype, cols))
    assert_bits_equal(dequantize_rows(torch.from_numpy(raw), qtype, cols), reference(raw, qtype))


def test_gguf_cannot_quantize_k_types():
    # Why the K-quant tests use random blocks; if gguf learns to, quantized data can be added.
    x = np.zeros((1, 256), np.float32)
    for t in (GGMLType.Q4_K, GGMLType.Q5_K, GGMLType.Q6_K):
        with pytest.raises(NotImplementedError):
            quantize(x, Q(int(t)))


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_non_contiguous_row_selections(qtype):
    cols = 2 * BLOCK_SHAPE[qtype][0]
    raw = random_blocks(qtype, 40, cols, seed=7)
    blocks = torch.from_numpy(raw)
    idx = torch.tensor([39, 0, 5, 5, 17, 2])  # shuffled, repeated
    assert_bits_equal(dequantize_rows(blocks[idx], qtype, cols), reference(raw[idx.numpy()], qtype))
    assert_bits_equal(dequantize_rows(blocks[1::3], qtype, cols), reference(raw[1::3], qtype))
    # rows inside a wider buffer at an odd byte offset: fp16 fields are not 2-byte aligned
    wide = torch.zeros(40, raw.shape[1] + 5, dtype=torch.uint8)
    wide[:, 3 : 3 + raw.shape[1]] = blocks
    assert_bits_equal(
        dequantize_rows(wide[:, 3 : 3 + raw.shape[1]], qtype, cols), reference(raw, qtype)
    )


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_output_dtype_is_a_cast_of_float32(qtype):
    cols = BLOCK_SHAPE[qtype][0]
    blocks = torch.from_numpy(random_blocks(qtype, 5, cols, seed=3, scales="small"))
    f32 = dequantize_rows(blocks, qtype, cols)
    for dtype in (torch.bfloat16, torch.float16):
        got = dequantize_rows(blocks, qtype, cols, dtype)
        assert got.dtype == dtype and torch.equal(got, f32.to(dtype))


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_non_finite_scales_give_non_finite_values_where_gguf_does(qtype):
    # Fully random bytes, fp16 scales included (NaN/inf); only NaN payloads may differ (which
    # NaN an operation returns is the CPU's, per operand order), so compare values, NaN == NaN.
    cols = BLOCK_SHAPE[qtype][0]
    rng = np.random.default_rng(11)
    raw = rng.integers(0, 256, (64, row_bytes(qtype, cols)), dtype=np.uint8)
    with np.errstate(invalid="ignore", over="ignore"):  # inf * 0, inf - inf in the reference
        want = reference(raw, qtype)
    np.testing.assert_array_equal(dequantize_rows(torch.from_numpy(raw), qtype, cols).numpy(), want)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_no_rows(qtype):
    cols = 2 * BLOCK_SHAPE[qtype][0]
    blocks = torch.empty(0, row_bytes(qtype, cols), dtype=torch.uint8)
    empty = dequantize_rows(blocks, qtype, cols, torch.bfloat16)
    assert empty.shape == (0, cols) and empty.dtype == torch.bfloat16
    ids = torch.empty(0, dtype=torch.long)
    assert dequantize_embedding(ids, blocks, qtype, cols, torch.float32).shape == (0, cols)
    assert dequantize_linear(torch.ones(2, cols), blocks, qtype, cols).shape == (2, 0)


def test_malformed_inputs():
    qtype, cols = GGMLType.Q4_K, 512
    for bad in (
        torch.zeros(2, 287, dtype=torch.uint8),  # row_bytes does not match cols
        torch.zeros(2, 288, dtype=torch.int8),  # not uint8
        torch.zeros(576, dtype=torch.uint8),  # not [rows, row_bytes]
    ):
        with pytest.raises(ValueError):
            dequantize_rows(bad, qtype, cols)
    with pytest.raises(ValueError):
        dequantize_rows(torch.zeros(2, 36, dtype=torch.uint8), int(Q.Q5_0), 64)


def f32_bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Worst-case difference between two float32 evaluations of x @ w.T that use the same
    products but may sum them in different orders (GEMM blocking, kernel choice, chunk
    boundaries): each is within gamma_K * sum|x_i w_i| of the exact value, gamma_K ~ K * 2^-24
    (Higham, recursive summation), so they are within twice that of each other. This is tight:
    a wrong weight, scale or row would be off by a whole term, far above K * 2^-24 of the sum."""
    k = x.shape[-1]
    return 2 * k * 2.0**-24 * (x.abs().double() @ w.abs().double().T)


def reference_linear(
    x: torch.Tensor, raw: np.ndarray, qtype: GGMLType, bias: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(float64 x @ W^T + bias with W gguf's float32 dequantization, its float32 bound)."""
    w = torch.from_numpy(reference(raw, qtype))
    x2 = x.reshape(-1, x.shape[-1]).to(torch.float32)
    y = x2.double() @ w.double().T
    if bias is not None:
        y = y + bias.double()
    bound = f32_bound(x2, w) + (y.abs() * 2.0**-24 if bias is not None else 0)
    return y.reshape(*x.shape[:-1], -1), bound.reshape(*x.shape[:-1], -1)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("with_bias", [False, True])
def test_linear_float32(qtype, with_bias):
    rows, cols = 37, 3 * BLOCK_SHAPE[qtype][0]
    raw = random_blocks(qtype, rows, cols, seed=5, scales="small")
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, cols, generator=g)
    bias = torch.randn(rows, generator=g) if with_bias else None
    got = dequantize_linear(x, torch.from_numpy(raw), qtype, cols, bias=bias)
    want, bound = reference_linear(x, raw, qtype, bias)
    assert got.dtype == torch.float32 and got.shape == (2, 3, rows)
    assert ((got.double() - want).abs() <= bound).all()


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_linear_bfloat16(qtype):
    rows, cols = 37, 2 * BLOCK_SHAPE[qtype][0]
    raw = random_blocks(qtype, rows, cols, seed=6, scales="small")
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4, cols, generator=g).to(torch.bfloat16)
    bias = torch.randn(rows, generator=g).to(torch.bfloat16)
    got = dequantize_linear(x, torch.from_numpy(raw), qtype, cols, bias=bias)
    want, bound = reference_linear(x, raw, qtype, bias)
    assert got.dtype == torch.bfloat16 and got.shape == (4, rows)
    # The float32 result is rounded once to bf16 (8-bit significand): at most half an ulp,
    # 2^-8 of the value's magnitude, on top of the float32 summation bound.
    assert ((got.double() - want).abs() <= want.abs() * 2.0**-8 + 2 * bound).all()


@pytest.mark.parametrize("qtype", [GGMLType.Q8_0, GGMLType.Q4_K, GGMLType.Q6_K], ids=str)
def test_linear_chunking(qtype, monkeypatch):
    rows, cols = 50, 2 * BLOCK_SHAPE[qtype][0]
    raw = torch.from_numpy(random_blocks(qtype, rows, cols, seed=8, scales="small"))
    x = torch.randn(3, cols, generator=torch.Generator().manual_seed(2))
    w = dequantize_rows(raw, qtype, cols)
    seen: list[int] = []

    def recording(blocks, *args, **kwargs):
        seen.append(blocks.shape[0])
        return dequantize_rows(blocks, *args, **kwargs)

    monkeypatch.setattr(ggml_blocks, "dequantize_rows", recording)
    whole = dequantize_linear(x, raw, qtype, cols, chunk_rows=rows)
    for chunk in (1, 7, 49, 1000):
        seen.clear()
        got = dequantize_linear(x, raw, qtype, cols, chunk_rows=chunk)
        # memory: never more than one chunk of rows in floating point at a time
        assert max(seen) == min(chunk, rows) and sum(seen) == rows
        assert ((got.double() - whole.double()).abs() <= f32_bound(x, w)).all()
    seen.clear()
    dequantize_linear(x, raw, qtype, cols)  # default chunk: whole (small) weight in one
    assert seen == [rows]
    seen.clear()
    monkeypatch.setattr(ggml_blocks, "_CHUNK_ELEMENTS", 20 * cols)  # default: a budget
    dequantize_linear(x, raw, qtype, cols)
    assert seen == [20, 20, 10]
    with pytest.raises(ValueError):
        dequantize_linear(x, raw, qtype, cols, chunk_rows=0)


def test_linear_rejects_mismatches():
    qtype, cols = GGMLType.Q8_0, 64
    raw = torch.from_numpy(random_blocks(qtype, 4, cols, seed=9, scales="small"))
    with pytest.raises(ValueError):
        dequantize_linear(torch.randn(2, 32), raw, qtype, cols)
    with pytest.raises(ValueError):
        dequantize_linear(torch.randn(2, cols), raw, qtype, cols, bias=torch.zeros(5))
    with pytest.raises(TypeError):
        dequantize_linear(torch.randn(2, cols).half(), raw, qtype, cols)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_embedding(qtype):
    vocab, cols = 30, BLOCK_SHAPE[qtype][0]
    raw = random_blocks(qtype, vocab, cols, seed=10, scales="small")
    table = torch.from_numpy(reference(raw, qtype))
    ids = torch.tensor([[3, 29, 0], [3, 3, 11]])
    got = dequantize_embedding(ids, torch.from_numpy(raw), qtype, cols, torch.float32)
    assert got.shape == (2, 3, cols) and torch.equal(got, table[ids])
    bf16 = dequantize_embedding(ids, torch.from_numpy(raw), qtype, cols, torch.bfloat16)
    assert torch.equal(bf16, table[ids].to(torch.bfloat16))
    one = dequantize_embedding(torch.tensor(7), torch.from_numpy(raw), qtype, cols, torch.float32)
    assert one.shape == (cols,) and torch.equal(one, table[7])
