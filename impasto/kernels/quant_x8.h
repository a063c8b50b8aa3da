// Packed GGML weights with rows interleaved in groups of 8 (quant_x8.cpp), the layout the
// matmul uses once a weight is repacked; see that file for the layout and the arithmetic.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

#include "quant_blocks.h"

namespace impasto_quant {

// A segment's type id in the repacked layout: GGML's id | kX8Flag.
constexpr int64_t kX8Flag = 1 << 8;

// Whether this build has the interleaved kernels for GGML type `qtype`.
bool x8_supported(int64_t qtype);

// Bytes of one group of 8 rows of `cols` values of GGML type `qtype` in the repacked layout
// (8 GGML rows' bytes; Q4_K's 2.8 % more).
int64_t x8_group_bytes(int64_t qtype, int64_t cols);

// uint8 [rows, row_bytes] in GGML's layout (rows a multiple of 8) -> uint8 [rows / 8, group_bytes].
at::Tensor x8_repack(const at::Tensor& blocks, int64_t qtype);

// Output columns col0 + 8 g .. col0 + 8 g + 7 for row groups g in [g_lo, g_hi), all `rows`
// activation rows. `acts` are ActQ8 (32-blocks types) or ActQ8K (K-quants), `nb` per row.
void x8_run(int64_t qtype, const uint8_t* w, int64_t group_bytes, int64_t g_lo, int64_t g_hi, const void* acts,
            int64_t nb, int64_t rows, const Out& y, int64_t col0);

}  // namespace impasto_quant
