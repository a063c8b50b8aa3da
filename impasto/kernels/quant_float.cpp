// The float kernel of the packed matmul (quant_ops.cpp drives it): y = x W^T on GGML rows with
// the activations kept in float32, no 8-bit rounding. It serves `quant_linear_float` (float32
// models: what a float32 model on the dequantized weights computes, to float32 summation
// order, e.g. the logprobs of an evaluation or a comparison with transformers) and every call
// on a build without AVX2. The integer kernels (quant_rows.cpp, quant_x8.cpp) are llama.cpp's
// arithmetic and the fast one; this is the faithful one.
//
// Invariants: each weight row is dequantized to float32 exactly as the gguf package does
// (dequant_row, quant_dequant.cpp); an output is dot(x row, weight row) in vec_math's fixed
// order (dot4 is dot bit for bit), plus the bias, rounded once to y's dtype, so nothing in it
// depends on the other rows of the call, on tiling or on threads (batch invariance).
#include "quant_rows.h"
#include "vec_math.h"

#include <algorithm>
#include <vector>

namespace impasto_quant {

// Weight rows dequantized per pass: 4 (one dot4) x up to 8960 floats = 143 KB stays in L2
// while every activation row meets it.
constexpr int64_t kRowTile = 4;

void float_rows_run(int64_t qtype, const uint8_t* w, int64_t row_bytes, int64_t o_lo, int64_t o_hi, const float* xf,
                    int64_t rows, int64_t n, const Out& y, int64_t col0) {
  std::vector<float> wt(kRowTile * n);
  const float* ws[kRowTile] = {wt.data(), wt.data() + n, wt.data() + 2 * n, wt.data() + 3 * n};
  float s[kRowTile];
  for (int64_t o0 = o_lo; o0 < o_hi; o0 += kRowTile) {
    const int64_t m = std::min(kRowTile, o_hi - o0);
    for (int64_t j = 0; j < m; ++j) dequant_row(qtype, w + (o0 + j) * row_bytes, wt.data() + j * n, n);
    for (int64_t t = 0; t < rows; ++t) {
      const float* xt = xf + t * n;
      if (m == kRowTile) impasto_vec::dot4(xt, ws, n, s);
      else
        for (int64_t j = 0; j < m; ++j) s[j] = impasto_vec::dot(xt, ws[j], n);
      for (int64_t j = 0; j < m; ++j) y.store(t, col0 + o0 + j, s[j]);
    }
  }
}

}  // namespace impasto_quant
