// GGML's row layout (a weight row is consecutive blocks, as in the file), for the packed
// matmul's driver (quant_ops.cpp): the integer dot-product kernels (quant_rows.cpp) and the
// scalar dequantization (quant_dequant.cpp, which also serves the embedding lookup).
#pragma once

#include <cstdint>

#include "quant_blocks.h"

namespace impasto_quant {

// Output columns col0 + o for weight rows o in [o_lo, o_hi) (`row_bytes` apart from `w`), all
// `rows` activation rows. `acts` are ActQ8 (32-blocks types) or ActQ8K (K-quants), `nb` per row.
// Builds without AVX2 have no such kernels (the driver dequantizes instead).
void rows_run(int64_t qtype, const uint8_t* w, int64_t row_bytes, int64_t o_lo, int64_t o_hi, const void* acts,
              int64_t nb, int64_t rows, const Out& y, int64_t col0);

// One row of `n` values of GGML type `qtype` to float32: embedding lookups, and the portable
// matmul path.
void dequant_row(int64_t qtype, const uint8_t* row, float* y, int64_t n);

}  // namespace impasto_quant
