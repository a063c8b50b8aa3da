// GGML's row layout (a weight row is consecutive blocks, as in the file), for the packed
// matmul's driver (quant_ops.cpp): the integer dot-product kernels (quant_rows.cpp), the
// dequantization (quant_dequant.cpp, which also serves the embedding lookup) and the float
// kernel built on it (quant_float.cpp).
#pragma once

#include <cstdint>

#include "quant_blocks.h"

namespace impasto_quant {

// Output columns col0 + o for weight rows o in [o_lo, o_hi) (`row_bytes` apart from `w`), all
// `rows` activation rows. `acts` are ActQ8 (32-blocks types) or ActQ8K (K-quants), `nb` per row.
// Builds without AVX2 have no such kernels (the driver dequantizes instead).
void rows_run(int64_t qtype, const uint8_t* w, int64_t row_bytes, int64_t o_lo, int64_t o_hi, const void* acts,
              int64_t nb, int64_t rows, const Out& y, int64_t col0);

// One row of `n` values of GGML type `qtype` to float32: embedding lookups, and the float
// matmul below.
void dequant_row(int64_t qtype, const uint8_t* row, float* y, int64_t n);

// The same outputs with float32 activations `xf` [rows, n] (quant_float.cpp): each weight row
// dequantized exactly, met by dot products in vec_math's fixed order.
void float_rows_run(int64_t qtype, const uint8_t* w, int64_t row_bytes, int64_t o_lo, int64_t o_hi, const float* xf,
                    int64_t rows, int64_t n, const Out& y, int64_t col0);

}  // namespace impasto_quant
