// The op `quant_linear_float`: y = x W^T (+ b) on packed GGML weights with the activations kept
// in float32 (no 8-bit rounding), for float32 models. quant_linear (quant_ops.cpp) rounds every
// activation row to 8-bit blocks, which is llama.cpp's arithmetic and the fast one; this op is
// the faithful one: each weight row is dequantized to float32 exactly as the gguf package does
// (dequant_row, quant_dequant.cpp) and meets the activations in float32 fused multiply-adds, so
// a float32 model on packed weights computes what a float32 model on the dequantized weights
// computes, to float32 summation order (the logprobs of an evaluation, a comparison with
// transformers).
//
// Invariants: an output is dot(x row, weight row) in vec_math's fixed order (dot4 is dot bit
// for bit), plus the bias, rounded once to x's dtype; nothing in it depends on the other rows
// of the call, on tiling or on threads (batch invariance, as quant_linear). Weights are GGML's
// row layout (segments as the file holds them), never the interleaved one.
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <vector>

#include "quant_ops.h"
#include "quant_rows.h"
#include "vec_math.h"

namespace impasto_quant {
namespace {

// Weight rows dequantized per pass: 4 (one dot4) x up to 8960 floats = 143 KB stays in L2
// while every activation row meets it.
constexpr int64_t kRowTile = 4;

void run_tile(int64_t qtype, const uint8_t* w, int64_t row_bytes, int64_t o_lo, int64_t o_hi,
              const float* xf, int64_t rows, int64_t n, const Out& y, int64_t col0) {
  std::vector<float> wt(kRowTile * n);
  float s[kRowTile];
  for (int64_t o0 = o_lo; o0 < o_hi; o0 += kRowTile) {
    const int64_t m = std::min(kRowTile, o_hi - o0);
    for (int64_t j = 0; j < m; ++j) dequant_row(qtype, w + (o0 + j) * row_bytes, wt.data() + j * n, n);
    const float* ws[kRowTile] = {wt.data(), wt.data() + n, wt.data() + 2 * n, wt.data() + 3 * n};
    for (int64_t t = 0; t < rows; ++t) {
      const float* xt = xf + t * n;
      if (m == kRowTile) impasto_vec::dot4(xt, ws, n, s);
      else
        for (int64_t j = 0; j < m; ++j) s[j] = impasto_vec::dot(xt, ws[j], n);
      for (int64_t j = 0; j < m; ++j) y.store(t, col0 + o0 + j, s[j]);
    }
  }
}

// Any leading shape: [..., I] -> [..., O], O the segments' rows in order.
at::Tensor quant_linear_float(const at::Tensor& x_in, at::TensorList blocks, at::IntArrayRef qtypes,
                              const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x_in.dim() >= 1, "quant_linear_float: x must have at least one dimension");
  TORCH_CHECK(x_in.scalar_type() == at::kFloat || x_in.scalar_type() == at::kBFloat16,
              "quant_linear_float: x must be float32 or bfloat16");
  TORCH_CHECK(!blocks.empty() && blocks.size() == qtypes.size(), "quant_linear_float: one GGML type per segment");
  const int64_t n = x_in.size(-1);
  const at::Tensor x = x_in.reshape({-1, n}).to(at::kFloat).contiguous();  // [T, I] float32
  const int64_t rows = x.size(0);
  int64_t out_f = 0;
  for (size_t s = 0; s < blocks.size(); ++s) {
    const TypeInfo ti = type_info(qtypes[s]);  // refuses types it has no dequantization for
    const at::Tensor& b = blocks[s];
    TORCH_CHECK(b.scalar_type() == at::kByte && b.dim() == 2 && b.is_contiguous(),
                "quant_linear_float: blocks must be contiguous uint8 [rows, row_bytes]");
    TORCH_CHECK(n % ti.elems == 0 && b.size(1) == n / ti.elems * ti.bytes, "quant_linear_float: x has ", n,
                " features, which does not match the packed row of ", b.size(1), " bytes of GGML type ", qtypes[s]);
    out_f += b.size(0);
  }
  if (bias.has_value())
    TORCH_CHECK(bias->is_contiguous() && bias->numel() == out_f && bias->scalar_type() == x_in.scalar_type(),
                "quant_linear_float: bias must be a contiguous [O] tensor of x's dtype");
  auto y = at::empty({rows, out_f}, x_in.options());
  const Out out = output_of(y, bias);
  const float* xf = x.const_data_ptr<float>();
  int64_t col0 = 0;
  for (size_t s = 0; s < blocks.size(); ++s) {
    const int64_t seg_rows = blocks[s].size(0), row_bytes = blocks[s].size(1);
    const uint8_t* w = blocks[s].const_data_ptr<uint8_t>();
    if (rows > 0)  // tasks of whole tiles: a tile's rows are dequantized once
      at::parallel_for(0, (seg_rows + kRowTile - 1) / kRowTile, 1, [&](int64_t lo, int64_t hi) {
        run_tile(qtypes[s], w, row_bytes, lo * kRowTile, std::min(seg_rows, hi * kRowTile), xf, rows, n, out, col0);
      });
    col0 += seg_rows;
  }
  auto shape = x_in.sizes().vec();
  shape.back() = out_f;
  return y.view(shape);
}

}  // namespace
}  // namespace impasto_quant

TORCH_LIBRARY_FRAGMENT(impasto, m) {
  m.def("quant_linear_float(Tensor x, Tensor[] blocks, int[] qtypes, Tensor? bias=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(impasto, CPU, m) { m.impl("quant_linear_float", &impasto_quant::quant_linear_float); }
