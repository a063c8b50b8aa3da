// The skinny bf16 linear of the 16-bit decode path (see impasto/kernels/__init__.py): the op
// `linear_bf16` (y = x @ w^T + b, any leading shape) and `linear_2d`, its [T, I] form, which the
// decoder stack (cpu_ops.cpp) calls for dense weights. Why a kernel of its own, and how it
// reads the weights: the comment above kRowBlock.
//
// Invariants: bfloat16 in and out, float32 accumulation, one rounding (to nearest even) on
// store. Threads split the weight rows (blocks of kRowBlock), so the thread count changes no
// bit. The summation order of an output does depend on its x row's neighbours: x rows go
// through the kernels in pairs, and a row left alone takes the one-row kernel, which sums in
// another order; so unlike the packed kernels (quant_ops.cpp) a row's bits can change with
// the number of rows in the call.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cstdint>
#include <optional>
#include <vector>

#include "cpu_ops.h"
#include "vec_math.h"

namespace impasto_cpu {
namespace {

using impasto_vec::from_f;
using impasto_vec::to_f;

// ---------------------------------------------------------------- skinny bf16 linear
// y [T, O] = x [T, I] @ w[O, I]^T (+ b), for the few rows of decode steps. The weight is read
// once per call and widened to float32 in registers (bf16 is the high half of a float32):
// 16 weights = one 32-byte load; `w << 16` gives the even-indexed ones and `w & 0xffff0000`
// the odd-indexed ones, which meet x split once per call into its even and odd elements
// (xs = [x[0], x[2], ..., x[1], x[3], ...]). Memory-bound at batch 1, where PyTorch's bf16
// matmul on CPUs without native bf16 instructions reaches about half the bandwidth.
// Work split: blocks of 4 weight rows per thread; x rows in tiles of 64 (kept in L2), within
// which one x row meets one weight row at a time, or two x rows meet 4 weight rows.
constexpr int64_t kRowBlock = 4;
// Software prefetch distance for the one-row path: with rows of ~1 KiB the hardware prefetcher
// alone left ~30 % of the bandwidth unused (measured: 1-4 KiB ahead all help; 4 KiB best).
constexpr int64_t kPrefetchBytes = 4096;
constexpr int64_t kTokenTile = 64;

#if defined(__AVX2__) && defined(__FMA__)
inline float hsum(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 h = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(h, _mm_shuffle_ps(h, h, 1)));
}

// One weight row (RB = 1) against one x row: four accumulator chains, the weight read strictly
// sequentially, which the hardware prefetchers (plus a software prefetch) stream at full
// bandwidth; four short rows read side by side stream at about half of it (measured on a
// 576-column model). Returns the number of columns done (a multiple of 32).
inline int64_t gemm_row(const float* xs, int64_t in, const bf16* w, float& sum) {
  const int64_t half = (in + 1) / 2;
  const __m256i odd_mask = _mm256_set1_epi32(static_cast<int>(0xffff0000u));
  __m256 a[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
  int64_t i = 0;
  for (; i + 32 <= in; i += 32) {
    _mm_prefetch(reinterpret_cast<const char*>(w + i) + kPrefetchBytes, _MM_HINT_T0);
    for (int u = 0; u < 2; ++u) {
      const int64_t c = i + 16 * u;
      const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + c));
      const __m256 we = _mm256_castsi256_ps(_mm256_slli_epi32(raw, 16));
      const __m256 wo = _mm256_castsi256_ps(_mm256_and_si256(raw, odd_mask));
      a[2 * u] = _mm256_fmadd_ps(we, _mm256_loadu_ps(xs + c / 2), a[2 * u]);
      a[2 * u + 1] = _mm256_fmadd_ps(wo, _mm256_loadu_ps(xs + half + c / 2), a[2 * u + 1]);
    }
  }
  sum = hsum(_mm256_add_ps(_mm256_add_ps(a[0], a[1]), _mm256_add_ps(a[2], a[3])));
  return i;
}

// kRowBlock weight rows against two x rows: 8 accumulators (one per pair, even and odd columns
// folded into it) plus 4 x registers fit the 16 AVX registers. Each 16-column weight chunk is
// widened once and used for both x rows. Returns the number of columns done (a multiple of 16).
inline int64_t gemm_tile2(const float* xs, int64_t in, const bf16* w, float (&sums)[2][kRowBlock]) {
  const int64_t half = (in + 1) / 2;
  const __m256i odd_mask = _mm256_set1_epi32(static_cast<int>(0xffff0000u));
  __m256 a[2][kRowBlock];
  for (auto& t : a)
    for (auto& v : t) v = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= in; i += 16) {
    const __m256 xe0 = _mm256_loadu_ps(xs + i / 2), xo0 = _mm256_loadu_ps(xs + half + i / 2);
    const __m256 xe1 = _mm256_loadu_ps(xs + in + i / 2), xo1 = _mm256_loadu_ps(xs + in + half + i / 2);
    for (int r = 0; r < kRowBlock; ++r) {
      const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + r * in + i));
      const __m256 we = _mm256_castsi256_ps(_mm256_slli_epi32(raw, 16));
      const __m256 wo = _mm256_castsi256_ps(_mm256_and_si256(raw, odd_mask));
      a[0][r] = _mm256_fmadd_ps(wo, xo0, _mm256_fmadd_ps(we, xe0, a[0][r]));
      a[1][r] = _mm256_fmadd_ps(wo, xo1, _mm256_fmadd_ps(we, xe1, a[1][r]));
    }
  }
  for (int t = 0; t < 2; ++t)
    for (int r = 0; r < kRowBlock; ++r) sums[t][r] = hsum(a[t][r]);
  return i;
}
#endif

inline float x_at(const float* xs, int64_t in, int64_t j) {  // element j of a split row
  return j % 2 == 0 ? xs[j / 2] : xs[(in + 1) / 2 + j / 2];
}

inline void gemm_block(const float* xs, int64_t nt, int64_t in, const bf16* w, int64_t o0,
                       int64_t nrow, float* acc /* [nt, nrow] */) {
  for (int64_t t0 = 0; t0 < nt; t0 += 2) {
    const int64_t tt = std::min<int64_t>(2, nt - t0);
    float sums[2][kRowBlock] = {};
    int64_t i = 0;
#if defined(__AVX2__) && defined(__FMA__)
    if (tt == 1) {  // one x row: one weight row at a time, sequential reads
      for (int64_t r = 0; r < nrow; ++r) i = gemm_row(xs + t0 * in, in, w + (o0 + r) * in, sums[0][r]);
    } else if (nrow == kRowBlock) {
      i = gemm_tile2(xs + t0 * in, in, w + o0 * in, sums);
    }
#endif
    for (int64_t t = 0; t < tt; ++t)  // remainder columns (and the portable path)
      for (int64_t r = 0; r < nrow; ++r) {
        const bf16* wr = w + (o0 + r) * in;
        float s = sums[t][r];
        for (int64_t j = i; j < in; ++j) s += x_at(xs + (t0 + t) * in, in, j) * to_f(wr[j]);
        acc[(t0 + t) * nrow + r] = s;
      }
  }
}

}  // namespace

at::Tensor linear_2d(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  check_rows(x, "x");
  TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous() && weight.size(1) == x.size(1),
              "linear_bf16: weight must be a contiguous [O, I] tensor");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && weight.scalar_type() == at::kBFloat16,
              "linear_bf16: bfloat16 only");
  const int64_t nt = x.size(0), in = x.size(1), out_f = weight.size(0);
  const bf16* bp = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->is_contiguous() && bias->numel() == out_f && bias->scalar_type() == at::kBFloat16,
                "linear_bf16: bias must be a contiguous [O] bfloat16 tensor");
    bp = cdata<bf16>(*bias);
  }
  auto y = at::empty({nt, out_f}, x.options());
  std::vector<float> xs(nt * in + 1);  // rows split into (even | odd) elements
  const bf16* xp = cdata<bf16>(x);
  for (int64_t t = 0; t < nt; ++t)
    for (int64_t j = 0; j < in; ++j)
      xs[t * in + (j % 2 == 0 ? j / 2 : (in + 1) / 2 + j / 2)] = to_f(xp[t * x.stride(0) + j]);
  const bf16* wp = cdata<bf16>(weight);
  bf16* yp = mdata<bf16>(y);
  const int64_t blocks = (out_f + kRowBlock - 1) / kRowBlock;
  // ~64 KiB of weights per task at least: below that, a second thread costs more than it saves.
  const int64_t grain = std::max<int64_t>(1, (32768 / std::max<int64_t>(in, 1)) / kRowBlock);
  // Token tiles outside, weight blocks inside: a tile of x (64 rows) stays in L2 while this
  // thread's weights stream past it, instead of all of x streaming past every weight block.
  at::parallel_for(0, blocks, grain, [&](int64_t lo, int64_t hi) {
    float acc[kTokenTile * kRowBlock];
    for (int64_t t0 = 0; t0 < nt; t0 += kTokenTile) {
      const int64_t tn = std::min<int64_t>(kTokenTile, nt - t0);
      for (int64_t blk = lo; blk < hi; ++blk) {
        const int64_t o0 = blk * kRowBlock, nrow = std::min(kRowBlock, out_f - o0);
        gemm_block(xs.data() + t0 * in, tn, in, wp, o0, nrow, acc);
        for (int64_t t = 0; t < tn; ++t)
          for (int64_t r = 0; r < nrow; ++r) {
            const float b = bp != nullptr ? to_f(bp[o0 + r]) : 0.0f;
            yp[(t0 + t) * out_f + o0 + r] = from_f<bf16>(acc[t * nrow + r] + b);
          }
      }
    }
  });
  return y;
}

namespace {

// Any leading shape: [..., I] -> [..., O].
at::Tensor linear_bf16(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() >= 1, "linear_bf16: x must have at least one dimension");
  auto shape = x.sizes().vec();
  shape.back() = weight.size(0);
  if (x.numel() == 0) return at::empty(shape, x.options());  // (an empty x may have any strides)
  auto y = linear_2d(as_rows(x), weight, bias);
  return x.dim() == 2 ? y : y.view(shape);
}

}  // namespace
}  // namespace impasto_cpu

TORCH_LIBRARY_FRAGMENT(impasto, m) { m.def("linear_bf16(Tensor x, Tensor weight, Tensor? bias=None) -> Tensor"); }

TORCH_LIBRARY_IMPL(impasto, CPU, m) { m.impl("linear_bf16", &impasto_cpu::linear_bf16); }
