"""Pure-torch dequantization of GGML quantized blocks: the eager fallback for packed GGUF weights.

A packed weight is a uint8 tensor `[rows, row_bytes]`: row r holds the consecutive GGML blocks
of output feature r, exactly as the GGUF file stores them (`row_bytes = cols / block_elems *
block_bytes`). The C++ kernels compute on these bytes directly; this module is what runs when
they cannot be built, and the reference they are tested against.

Invariants:
- `dequantize_rows` is bit-identical (float32) to `gguf.quants.dequantize` for every type in
  `GGMLType`: same field layout, same float32 operations in the same order (the `gguf`
  package follows GGML's C dequantizers). Integer unpacking is exact, and so is every float
  product but one: an fp16 scale (11-bit significand) times 6- or 8-bit integer scales and
  4- to 6-bit quants fits float32's 24 bits, except Q6_K's d * scale * q (up to 25 bits),
  which rounds once however it is associated. Each value is therefore the correctly rounded
  `d*sc*q - dmin*m` (or `d*q + m`): the final add/subtract is the only other rounding, so
  another association, or an FMA, gives the same bits (what the C++ kernels may rely on).
- Work is vectorised over every block of every row at once; nothing loops in Python over rows
  or blocks.
- `dequantize_linear` never materialises the whole weight in floating point: it dequantizes
  `chunk_rows` rows at a time, so its extra memory is bounded by one chunk.
- Multi-byte fields (fp16 scales) are read in the host's byte order, which must be little
  endian like the files (the same assumption `gguf`'s numpy views make).
"""

from __future__ import annotations

import sys
from enum import IntEnum

import torch

if sys.byteorder != "little":  # pragma: no cover - every supported CPU is little endian
    raise ImportError("GGML block dequantization assumes a little-endian host")


class GGMLType(IntEnum):
    """GGML type ids (GGML's own numbering) of the block formats that can stay packed."""

    Q4_0 = 2
    Q4_1 = 3
    Q5_0 = 6
    Q5_1 = 7
    Q8_0 = 8
    Q4_K = 12
    Q5_K = 13
    Q6_K = 14


# (elements per block, bytes per block), as GGML_QUANT_SIZES in the gguf package.
BLOCK_SHAPE: dict[GGMLType, tuple[int, int]] = {
    GGMLType.Q4_0: (32, 18),
    GGMLType.Q4_1: (32, 20),
    GGMLType.Q5_0: (32, 22),
    GGMLType.Q5_1: (32, 24),
    GGMLType.Q8_0: (32, 34),
    GGMLType.Q4_K: (256, 144),
    GGMLType.Q5_K: (256, 176),
    GGMLType.Q6_K: (256, 210),
}

# Rows dequantized per step of `dequantize_linear` when the caller does not choose: enough
# float32 elements (1 Mi, 4 MiB) that the per-chunk Python overhead (~20 small ops) is
# negligible next to the unpacking and the GEMM, few enough that the chunk and its unpacking
# temporaries stay small. Chunks of 256 Ki to 4 Mi elements ran alike on a 4864-column
# matrix; below 64 Ki the per-op overhead dominates.
_CHUNK_ELEMENTS = 1 << 20


def is_packable(qtype: int) -> bool:
    """Whether GGML type id `qtype` is one of the block formats this module (and the kernels)
    handle."""
    return qtype in GGMLType._value2member_map_


def ggml_type(qtype: int) -> GGMLType:
    """`qtype` as a `GGMLType`; ValueError for any other GGML type id."""
    if not is_packable(qtype):
        raise ValueError(f"GGML type id {qtype} is not a packable block format")
    return GGMLType(qtype)


def row_bytes(qtype: int, cols: int) -> int:
    """Bytes of one packed row of `cols` elements; ValueError unless `cols` is a positive
    multiple of the block size (a row never ends inside a block)."""
    elems, nbytes = BLOCK_SHAPE[ggml_type(qtype)]
    if cols <= 0 or cols % elems:
        raise ValueError(
            f"{GGMLType(qtype).name} rows hold whole blocks of {elems} elements; got {cols} columns"
        )
    return cols // elems * nbytes


def dequantize_rows(
    blocks: torch.Tensor, qtype: int, cols: int, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Packed rows uint8 `[rows, row_bytes]` -> `[rows, cols]` in `dtype`.

    `blocks` may be any row selection (e.g. `blocks[idx]`, a strided slice). The values are
    computed in float32 (bit-identical to `gguf.quants.dequantize`) and cast at the end.
    """
    qt = ggml_type(qtype)
    expected = row_bytes(qt, cols)
    if blocks.dtype != torch.uint8 or blocks.dim() != 2 or blocks.shape[1] != expected:
        raise ValueError(
            f"{qt.name} with {cols} columns needs uint8 blocks [rows, {expected}]; "
            f"got {blocks.dtype} {tuple(blocks.shape)}"
        )
    rows = blocks.shape[0]
    block_bytes = BLOCK_SHAPE[qt][1]
    # One row of blocks per GGML block; reshape copies only if the selection is not already
    # laid out row after row (it never changes the bytes' order within a row).
    flat = blocks.reshape(-1, block_bytes)
    values = _DEQUANTIZERS[qt](flat)  # float32 [n_blocks, block elements]
    return values.reshape(rows, cols).to(dtype)


def dequantize_linear(
    x: torch.Tensor,
    blocks: torch.Tensor,
    qtype: int,
    cols: int,
    bias: torch.Tensor | None = None,
    chunk_rows: int | None = None,
) -> torch.Tensor:
    """y = x @ W^T (+ bias) for x `[..., cols]` (float32 or bfloat16), W the packed weight.

    The arithmetic is float32 whatever x's dtype: each chunk of W is dequantized to float32
    (exact), multiplied by x in float32, the bias added in float32, and the result rounded
    once to x's dtype. Dequantizing to bf16 instead would round every weight a second time
    (after the quantization) and drift from the reference the kernels are checked against;
    this is the fallback path, so accuracy wins over bf16 GEMM speed. Memory beyond x and y
    is one float32 chunk `[chunk_rows, cols]` (default: about 1 Mi elements) plus its
    unpacking temporaries, never the whole weight.
    """
    if x.dtype not in (torch.float32, torch.bfloat16):
        raise TypeError(f"dequantize_linear takes float32 or bfloat16 activations, not {x.dtype}")
    if x.shape[-1] != cols:
        raise ValueError(f"x has {x.shape[-1]} features, the weight {cols} columns")
    rows = blocks.shape[0]
    if bias is not None and bias.shape != (rows,):
        raise ValueError(f"bias shape {tuple(bias.shape)} does not match {rows} output rows")
    step = chunk_rows if chunk_rows is not None else max(1, _CHUNK_ELEMENTS // cols)
    if step <= 0:
        raise ValueError(f"chunk_rows must be positive, got {chunk_rows}")

    x32 = x.reshape(-1, cols).to(torch.float32)  # no copy when x is already float32
    out = torch.empty(x32.shape[0], rows, dtype=x.dtype, device=x.device)
    bias32 = bias.to(torch.float32) if bias is not None else None
    for start in range(0, rows, step):
        stop = min(start + step, rows)
        w = dequantize_rows(blocks[start:stop], qtype, cols)
        y = x32 @ w.T
        if bias32 is not None:
            y += bias32[start:stop]
        out[:, start:stop] = y  # the one rounding to x's dtype (none for float32)
    return out.reshape(*x.shape[:-1], rows)


def dequantize_embedding(
    ids: torch.Tensor, blocks: torch.Tensor, qtype: int, cols: int, dtype: torch.dtype
) -> torch.Tensor:
    """Rows `ids` (any shape of integer ids) of a packed embedding table -> `[*ids.shape, cols]`
    in `dtype`; only the looked-up rows are dequantized."""
    flat = ids.reshape(-1).to(torch.long)
    return dequantize_rows(blocks[flat], qtype, cols, dtype).reshape(*ids.shape, cols)


# --- per-format unpacking: uint8 [n_blocks, block bytes] -> float32 [n_blocks, block elems] ---


def _f16(b: torch.Tensor, offset: int) -> torch.Tensor:
    """The fp16 field at byte `offset` of each block as float32 `[n_blocks, 1]` (exact).
    The copy makes the 2-byte slice contiguous and 2-byte aligned so it can be viewed as fp16."""
    return b[:, offset : offset + 2].contiguous().view(torch.float16).to(torch.float32)


# Integer unpacking works on 64-bit words, 8 bytes per element of each op: the per-byte
# fields are at most 4 bits wide, so word-wide shifts and byte-replicated masks extract them
# for 8 bytes at once without mixing bytes (bits shifted in from a neighbouring byte, or the
# sign bits of an arithmetic shift, land where the mask clears them). This is several times
# fewer and longer element loops than byte-wise ops on 16- or 32-byte rows.
_LOW_NIBBLES = 0x0F0F0F0F0F0F0F0F
_LOW_BITS_1 = 0x0101010101010101
_LOW_BITS_2 = 0x0303030303030303


def _words(b: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    """Bytes `start:stop` of each block as int64 words `[n_blocks, (stop - start) / 8]`,
    copied into a fresh (so 8-byte aligned) tensor in the host's (little-endian) order."""
    out = torch.empty(b.shape[0], (stop - start) // 8, dtype=torch.int64)
    out.view(torch.uint8).copy_(b[:, start:stop])
    return out


def _nibbles(w: torch.Tensor) -> torch.Tensor:
    """Words `[..., k]` (bytes `[..., 8k]`) -> words `[..., 2, k]` (bytes `[..., 2, 8k]`): all
    the low nibbles, then all the high ones. GGML stores element i in the low nibble of byte i
    and element i + n in its high nibble (halves, not interleaved) in every 4-bit field here."""
    out = torch.empty((*w.shape[:-1], 2, w.shape[-1]), dtype=torch.int64)
    torch.bitwise_and(w, _LOW_NIBBLES, out=out[..., 0, :])
    torch.bitwise_right_shift(w, 4, out=out[..., 1, :]).bitwise_and_(_LOW_NIBBLES)
    return out


def _as_bytes(w: torch.Tensor, *shape: int) -> torch.Tensor:
    """Words back to their bytes as a uint8 tensor of `shape` (a view, no copy)."""
    return w.view(torch.uint8).view(shape)


# After unpacking, the quants are converted to float32 once and the float ops run in place
# on that fresh tensor (fewer passes over memory, no extra allocations), in gguf's order.


def _q4_0(b: torch.Tensor) -> torch.Tensor:
    # [d fp16][16 bytes: 32 nibbles]; value = d * (q - 8)
    q = _as_bytes(_nibbles(_words(b, 2, 18)), -1, 32).view(torch.int8).sub_(8)  # -8..7
    return q.to(torch.float32).mul_(_f16(b, 0))


def _q4_1(b: torch.Tensor) -> torch.Tensor:
    # [d fp16][m fp16][16 bytes: 32 nibbles]; value = d * q + m (the product is exact)
    q = _as_bytes(_nibbles(_words(b, 4, 20)), -1, 32).to(torch.float32)
    return q.mul_(_f16(b, 0)).add_(_f16(b, 2))


# Bit j of a Q5_0 / Q5_1 block's 32-bit qh word is the fifth bit of element j.
_QH_SHIFTS_5 = torch.arange(32, dtype=torch.int32)


def _q5_quants(b: torch.Tensor, qh: int) -> torch.Tensor:
    """Q5_0 / Q5_1's quants (qh word at byte `qh`, 16 nibble bytes after it) as uint8 [n, 32]."""
    low = _as_bytes(_nibbles(_words(b, qh + 4, qh + 20)), -1, 32)
    bits = torch.empty(b.shape[0], 1, dtype=torch.int32)  # fresh, so 4-byte aligned
    bits.view(torch.uint8).copy_(b[:, qh : qh + 4])  # little endian
    high = ((bits >> _QH_SHIFTS_5) & 1).to(torch.uint8) << 4
    return low | high


def _q5_0(b: torch.Tensor) -> torch.Tensor:
    # [d fp16][qh: 4 bytes][16 bytes: 32 nibbles]; value = d * (q - 16)
    q = _q5_quants(b, 2).view(torch.int8).sub_(16)  # -16..15
    return q.to(torch.float32).mul_(_f16(b, 0))


def _q5_1(b: torch.Tensor) -> torch.Tensor:
    # [d fp16][m fp16][qh: 4 bytes][16 bytes: 32 nibbles]; value = d * q + m
    return _q5_quants(b, 4).to(torch.float32).mul_(_f16(b, 0)).add_(_f16(b, 2))


def _q8_0(b: torch.Tensor) -> torch.Tensor:
    # [d fp16][32 int8]; value = q * d
    return b[:, 2:34].view(torch.int8).to(torch.float32).mul_(_f16(b, 0))


def _k_scales_mins(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The 12 scale bytes of Q4_K/Q5_K -> (scales, mins) as float32 `[n_blocks, 8]`, each a
    6-bit integer. Sub-blocks 0-3 keep scale and min in the low 6 bits of bytes 0-3 and 4-7;
    sub-blocks 4-7 take their low 4 bits from the nibbles of bytes 8-11 and their top 2 bits
    from the spare top bits of bytes 0-3 (scales) and 4-7 (mins)."""
    lo_sc, lo_m, packed = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    scales = torch.cat((lo_sc & 0x3F, (packed & 0x0F) | ((lo_sc >> 2) & 0x30)), dim=1)
    mins = torch.cat((lo_m & 0x3F, (packed >> 4) | ((lo_m >> 2) & 0x30)), dim=1)
    return scales.to(torch.float32), mins.to(torch.float32)


def _k4_low_nibbles(b: torch.Tensor, start: int) -> torch.Tensor:
    """Q4_K/Q5_K's 128 quant bytes at `start` -> the low 4 bits of the 256 elements as words
    `[n, 4, 2, 4]` (bytes `[n, 8, 32]`): each 32-byte group j holds sub-block 2j in its low
    nibbles and sub-block 2j + 1 in its high ones."""
    return _nibbles(_words(b, start, start + 128).view(-1, 4, 4))


def _scaled_k(b: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    # value = (d * scale) * q - (dmin * min), gguf's order; the products are exact, so the
    # subtraction is the one rounding.
    scales, mins = _k_scales_mins(b[:, 4:16])
    dl = (_f16(b, 0) * scales).unsqueeze(-1)  # [n, 8, 1]
    ml = (_f16(b, 2) * mins).unsqueeze(-1)
    return q.to(torch.float32).mul_(dl).sub_(ml).reshape(-1, 256)


def _q4_k(b: torch.Tensor) -> torch.Tensor:
    # [d fp16][dmin fp16][12 scale bytes][128 quant bytes]
    return _scaled_k(b, _as_bytes(_k4_low_nibbles(b, 16), -1, 8, 32))


# Bit j of Q5_K's qh byte l is the fifth bit of element l of sub-block j.
_QH_SHIFTS_5K = torch.arange(8, dtype=torch.int64).view(1, 8, 1)


def _q5_k(b: torch.Tensor) -> torch.Tensor:
    # [d fp16][dmin fp16][12 scale bytes][32 qh bytes][128 quant bytes]
    high = (_words(b, 16, 48).unsqueeze(1) >> _QH_SHIFTS_5K).bitwise_and_(_LOW_BITS_1)
    low = _k4_low_nibbles(b, 48).view(-1, 8, 4)  # words of sub-block j, like high[:, j]
    q = low.bitwise_or_(high.bitwise_left_shift_(4))
    return _scaled_k(b, _as_bytes(q, -1, 8, 32))


# Each Q6_K qh byte carries the top 2 bits of four elements, 32 apart.
_QH_SHIFTS_6K = torch.tensor([0, 2, 4, 6], dtype=torch.int64).view(1, 1, 4, 1)


def _q6_k(b: torch.Tensor) -> torch.Tensor:
    # [128 ql bytes][64 qh bytes][16 int8 scales][d fp16]; two halves of 128 elements, half h
    # using ql bytes 64h..64h+63 (element r: low nibble for r < 64, high for r >= 64) and qh
    # bytes 32h..32h+31 (element r: bits 2*(r // 32)..+1 of byte r % 32).
    low = _nibbles(_words(b, 0, 128).view(-1, 2, 8)).view(-1, 2, 16)  # bytes [n, 2, 128]
    high = _words(b, 128, 192).view(-1, 2, 1, 4) >> _QH_SHIFTS_6K  # bytes [n, 2, 4, 32]
    high = high.bitwise_and_(_LOW_BITS_2).view(-1, 2, 16)
    q = _as_bytes(low.bitwise_or_(high.bitwise_left_shift_(4)), -1, 16, 16)
    q = q.view(torch.int8).sub_(32)  # 0..63 -> -32..31
    scales = b[:, 192:208].view(torch.int8).to(torch.float32)
    dl = (_f16(b, 208) * scales).unsqueeze(-1)  # [n, 16, 1]: one scale per 16 elements
    return q.to(torch.float32).mul_(dl).reshape(-1, 256)


_DEQUANTIZERS = {
    GGMLType.Q4_0: _q4_0,
    GGMLType.Q4_1: _q4_1,
    GGMLType.Q5_0: _q5_0,
    GGMLType.Q5_1: _q5_1,
    GGMLType.Q8_0: _q8_0,
    GGMLType.Q4_K: _q4_k,
    GGMLType.Q5_K: _q5_k,
    GGMLType.Q6_K: _q6_k,
}
