// Linear layers on packed GGML weights (quant_ops.cpp), shared with the decoder stack
// (cpu_ops.cpp). See impasto/kernels/quant.py for the formats and the arithmetic.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <vector>

namespace impasto_quant {

// y [T, sum of segment rows] = x [T, I] @ W^T (+ bias), W given as row segments of packed GGML
// blocks (segment i: `blocks[i]` uint8 [rows_i, row_bytes], of type `qtypes[i]`, GGML's ids).
// x float32 or bfloat16 (last dim contiguous); y has x's dtype. float_acts: keep x in float32
// (exact dequantization, float FMAs; GGML's row layout only) instead of 8-bit blocks.
at::Tensor linear_segments(const at::Tensor& x, const std::vector<at::Tensor>& blocks,
                           const std::vector<int64_t>& qtypes, const std::optional<at::Tensor>& bias,
                           bool float_acts = false);

}  // namespace impasto_quant
