// The matmul on packed GGML weights (see impasto/kernels/quant.py): the ops `quant_linear` and
// `quant_linear_float`, and linear_segments, their form for the decoder stack (cpu_ops.cpp).
// This file is the driver: it checks the segments, quantizes the activations and hands weight
// rows to the kernels of their layout, GGML's rows (quant_rows.cpp) or rows interleaved by 8
// (quant_x8.cpp). `quant_linear_float` (float32 models), and every call on a build without
// AVX2, keeps the activations in float32 instead and hands GGML's rows to the float kernel
// (quant_float.cpp: exact dequantization, float32 FMAs in a fixed order).
//
// Arithmetic (chosen by measurement, docs/benchmarks.md): each activation row is quantized
// once per call to 8-bit blocks (32 values + a float scale for the 32-blocks types, 256 values +
// a scale + sums of 16 for the K-quants), and every weight block meets it in integer dot
// products (u8 x s8 -> s32: VNNI's dpbusd where the CPU has it, AVX2's maddubs + madd
// elsewhere). The integer sums are exact and identical on both instruction sets; per block
// they are widened once to float and accumulated in a fixed order that depends only on the
// weight row and the activation row. So a row's result never depends on which other rows
// share the call, how rows are tiled, or how many threads run (batch invariance: prefill,
// chunked prefill, batched decode and speculative verification agree bit for bit).
//
// Weights: a row of a [O, I] matrix is I / block_elems consecutive blocks (GGML's layout,
// unchanged from the file). Types: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 (32-element blocks) and
// Q4_K, Q5_K, Q6_K (256-element super-blocks). Scales are IEEE half floats.
#include "quant_ops.h"
#include "quant_blocks.h"
#include "quant_rows.h"
#include "quant_x8.h"

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <vector>

namespace impasto_quant {
namespace {

// ---------------------------------------------------------------- the matmul driver
// Quantized activations of all rows for one family of types (32-blocks or K).
struct Acts {
  std::vector<ActQ8> q8;
  std::vector<ActQ8K> q8k;
  int64_t rows = 0, blocks32 = 0, blocks256 = 0;
};

void fill_acts(const at::Tensor& x, bool k, Acts& a) {
  const int64_t rows = x.size(0), n = x.size(1);
  a.rows = rows;
  if (k) a.blocks256 = n / 256, a.q8k.resize(rows * a.blocks256);
  else a.blocks32 = n / 32, a.q8.resize(rows * a.blocks32);
  at::parallel_for(0, rows, std::max<int64_t>(1, 65536 / std::max<int64_t>(n, 1)), [&](int64_t lo, int64_t hi) {
    std::vector<float> buf(n);
    for (int64_t t = lo; t < hi; ++t) {
      if (x.scalar_type() == at::kBFloat16) {
        const c10::BFloat16* src = x.const_data_ptr<c10::BFloat16>() + t * x.stride(0);
        for (int64_t i = 0; i < n; ++i) buf[i] = static_cast<float>(src[i]);
      } else {
        const float* src = x.const_data_ptr<float>() + t * x.stride(0);
        std::copy(src, src + n, buf.begin());
      }
      if (k) quantize_q8k(buf.data(), n, a.q8k.data() + t * a.blocks256);
      else quantize_q8(buf.data(), n, a.q8.data() + t * a.blocks32);
    }
  });
}

Out output_of(at::Tensor& y, const std::optional<at::Tensor>& bias) {
  Out out;
  out.stride = y.size(1);
  if (y.scalar_type() == at::kBFloat16) {
    out.bf16 = y.mutable_data_ptr<c10::BFloat16>();
    if (bias.has_value()) out.bias_bf16 = bias->const_data_ptr<c10::BFloat16>();
  } else {
    out.f32 = y.mutable_data_ptr<float>();
    if (bias.has_value()) out.bias_f32 = bias->const_data_ptr<float>();
  }
  return out;
}

}  // namespace

at::Tensor linear_segments(const at::Tensor& x_in, const std::vector<at::Tensor>& blocks,
                           const std::vector<int64_t>& qtypes, const std::optional<at::Tensor>& bias,
                           bool float_acts) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.stride(1) == 1, "quant_linear: x must be [T, I] with a contiguous last dim");
  TORCH_CHECK(x_in.scalar_type() == at::kBFloat16 || x_in.scalar_type() == at::kFloat,
              "quant_linear: x must be float32 or bfloat16");
  TORCH_CHECK(!blocks.empty() && blocks.size() == qtypes.size(), "quant_linear: one GGML type per segment");
  const at::Tensor& x = x_in;
  const int64_t rows = x.size(0), n = x.size(1);
  int64_t out_f = 0;
  for (size_t s = 0; s < blocks.size(); ++s) {
    const bool x8 = (qtypes[s] & kX8Flag) != 0;
    const int64_t qt = qtypes[s] & ~kX8Flag;
    const TypeInfo ti = type_info(qt);
    const at::Tensor& b = blocks[s];
    TORCH_CHECK(ti.elems > 0 && (!x8 || (x8_supported(qt) && !float_acts)), "quant_linear: unsupported GGML type ",
                qtypes[s], float_acts && x8 ? " (the float path reads GGML's row layout)" : "");
    TORCH_CHECK(b.scalar_type() == at::kByte && b.dim() == 2 && b.is_contiguous(),
                "quant_linear: blocks must be contiguous uint8 [rows, row_bytes]");
    TORCH_CHECK(n % ti.elems == 0 && b.size(1) == (x8 ? x8_group_bytes(qt, n) : n / ti.elems * ti.bytes),
                "quant_linear: x has ", n, " features, which does not match the packed row of ", b.size(1),
                " bytes of GGML type ", qtypes[s]);
    out_f += x8 ? 8 * b.size(0) : b.size(0);
  }
  if (bias.has_value())
    TORCH_CHECK(bias->is_contiguous() && bias->numel() == out_f && bias->scalar_type() == x.scalar_type(),
                "quant_linear: bias must be a contiguous [O] tensor of x's dtype");
  auto y = at::empty({rows, out_f}, x.options());
  if (rows == 0) return y;
  const Out out = output_of(y, bias);
#ifdef IMPASTO_AVX2
  Acts acts;
  bool have32 = false, have256 = false;
#else
  float_acts = true;  // no integer kernels on this build: every product is the float one
#endif
  const at::Tensor xf = float_acts ? x.to(at::kFloat).contiguous() : at::Tensor();  // [T, I]
  int64_t col0 = 0;
  for (size_t s = 0; s < blocks.size(); ++s) {
    const bool x8 = (qtypes[s] & kX8Flag) != 0;
    const int64_t qt = qtypes[s] & ~kX8Flag, row_bytes = blocks[s].size(1);
    const int64_t seg_rows = x8 ? 8 * blocks[s].size(0) : blocks[s].size(0);
    const uint8_t* w = blocks[s].const_data_ptr<uint8_t>();
    // At least ~32 KiB of weight passes per task (a weight row is read once per 4-5 activation
    // rows): below that a second thread costs more than it saves.
    const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(row_bytes * ((rows + 3) / 4), 1));
    if (float_acts) {  // tasks of whole 4-row tiles: a tile's rows are dequantized once
      at::parallel_for(0, (seg_rows + 3) / 4, std::max<int64_t>(1, grain / 4), [&](int64_t lo, int64_t hi) {
        float_rows_run(qt, w, row_bytes, 4 * lo, std::min(seg_rows, 4 * hi), xf.const_data_ptr<float>(), rows, n, out,
                       col0);
      });
      col0 += seg_rows;
      continue;
    }
#ifdef IMPASTO_AVX2
    const bool k = type_info(qt).k;
    if (k && !have256) fill_acts(x, true, acts), have256 = true;
    if (!k && !have32) fill_acts(x, false, acts), have32 = true;
    const void* a = k ? static_cast<const void*>(acts.q8k.data()) : static_cast<const void*>(acts.q8.data());
    const int64_t nb = k ? acts.blocks256 : acts.blocks32;
    if (x8) {
      at::parallel_for(0, blocks[s].size(0), grain, [&](int64_t lo, int64_t hi) {
        x8_run(qt, w, row_bytes, lo, hi, a, nb, rows, out, col0);
      });
      col0 += seg_rows;
      continue;
    }
    at::parallel_for(0, seg_rows, grain, [&](int64_t lo, int64_t hi) {
      rows_run(qt, w, row_bytes, lo, hi, a, nb, rows, out, col0);
    });
#endif
    col0 += seg_rows;
  }
  return y;
}

namespace {

// Any leading shape: [..., I] -> [..., O].
at::Tensor linear_any_shape(const at::Tensor& x, at::TensorList blocks, at::IntArrayRef qtypes,
                            const std::optional<at::Tensor>& bias, bool float_acts) {
  TORCH_CHECK(x.dim() >= 1, "quant_linear: x must have at least one dimension");
  const std::vector<at::Tensor> segs(blocks.begin(), blocks.end());
  const std::vector<int64_t> types(qtypes.begin(), qtypes.end());
  const at::Tensor rows = x.dim() == 2 && x.stride(1) == 1 ? x : x.contiguous().reshape({-1, x.size(-1)});
  auto y = linear_segments(rows, segs, types, bias, float_acts);
  auto shape = x.sizes().vec();
  shape.back() = y.size(1);
  return y.view(shape);
}

// 8-bit activation blocks and integer dot products (bf16 models).
at::Tensor quant_linear(const at::Tensor& x, at::TensorList blocks, at::IntArrayRef qtypes,
                        const std::optional<at::Tensor>& bias) {
  return linear_any_shape(x, blocks, qtypes, bias, false);
}

// float32 activations on exactly dequantized rows (float32 models; quant_float.cpp).
at::Tensor quant_linear_float(const at::Tensor& x, at::TensorList blocks, at::IntArrayRef qtypes,
                              const std::optional<at::Tensor>& bias) {
  return linear_any_shape(x, blocks, qtypes, bias, true);
}

// A packed [rows, row_bytes] weight in the interleaved layout (quant_x8.cpp); its type id in
// quant_linear becomes qtype | 256.
at::Tensor quant_repack(const at::Tensor& blocks, int64_t qtype) { return x8_repack(blocks, qtype); }
bool quant_repackable(int64_t qtype) { return x8_supported(qtype); }

// Which instruction set the integer dot products use on this build (benchmarks and logs).
std::string quant_isa() {
#if defined(IMPASTO_AVX2) && defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return "avx512-vnni";
#elif defined(IMPASTO_AVX2) && defined(__AVXVNNI__)
  return "avx-vnni";
#elif defined(IMPASTO_AVX2)
  return "avx2";
#else
  return "portable";
#endif
}

}  // namespace
}  // namespace impasto_quant

TORCH_LIBRARY_FRAGMENT(impasto, m) {
  m.def("quant_linear(Tensor x, Tensor[] blocks, int[] qtypes, Tensor? bias=None) -> Tensor");
  m.def("quant_linear_float(Tensor x, Tensor[] blocks, int[] qtypes, Tensor? bias=None) -> Tensor");
  m.def("quant_repack(Tensor blocks, int qtype) -> Tensor");
  m.def("quant_isa() -> str", &impasto_quant::quant_isa);
  m.def("quant_repackable(int qtype) -> bool", &impasto_quant::quant_repackable);
}

TORCH_LIBRARY_IMPL(impasto, CPU, m) {
  m.impl("quant_linear", &impasto_quant::quant_linear);
  m.impl("quant_linear_float", &impasto_quant::quant_linear_float);
  m.impl("quant_repack", &impasto_quant::quant_repack);
}
