// CPU kernels for the diffusion sampler's per-position work (float32; any model dtype).
//
// Why: one denoising step of a canvas turns [positions, vocab] logits into a sample, an argmax,
// an entropy and the probabilities that feed self-conditioning. In eager PyTorch that is about
// ten passes over [positions, vocab] with as many fresh buffers (soft-capping, temperature and
// grid snap, log-softmax, exp, entropy product, cumsum, search, argmax); at vocab 32k and canvas
// 64 they cost as much as a transformer layer. Here: soft-capping is one pass, the rest three,
// in place, with no allocation of that size.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <tuple>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

#include "vec_math.h"

namespace {

using impasto_vec::fast_exp;
using impasto_vec::fast_tanh;

// Elements summed in float before a partial sum goes to double: the CDF search skips whole
// blocks by their sums, then walks one block element by element.
constexpr int64_t kBlock = 256;

void check_logits(const at::Tensor& x) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.stride(1) == 1,
              "expected float32 logits [rows, vocab] with a contiguous last dim");
}

// x <- cap * tanh(x / cap), in place (Gemma's final logit soft-capping).
void softcap_(at::Tensor x, double cap) {
  check_logits(x);
  const int64_t rows = x.size(0), n = x.size(1), rs = x.stride(0);
  float* base = x.mutable_data_ptr<float>();
  const float c = static_cast<float>(cap), inv = 1.0f / c;
  at::parallel_for(0, rows, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      float* v = base + r * rs;
      for (int64_t i = 0; i < n; ++i) v[i] = c * fast_tanh(v[i] * inv);
    }
  });
}

// Pass 1: p = round_half_even(x * scale) / grid, written back; returns (max, first argmax).
// The rounding matches torch.round bit for bit, so the snapped logits equal the eager path's.
std::pair<float, int64_t> snap_row(float* x, int64_t n, float scale, float inv_grid) {
  float best = -std::numeric_limits<float>::infinity();
  int64_t arg = 0, i = 0;
#if defined(__AVX2__) && defined(__FMA__)
  const __m256 vs = _mm256_set1_ps(scale), vg = _mm256_set1_ps(inv_grid);
  __m256 vmax = _mm256_set1_ps(best);
  __m256i vidx = _mm256_setzero_si256(), cur = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256i step = _mm256_set1_epi32(8);
  for (; i + 8 <= n; i += 8) {
    const __m256 p = _mm256_mul_ps(
        _mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(x + i), vs), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC),
        vg);
    _mm256_storeu_ps(x + i, p);
    const __m256 gt = _mm256_cmp_ps(p, vmax, _CMP_GT_OQ);  // strictly greater: first index per lane
    vmax = _mm256_blendv_ps(vmax, p, gt);
    vidx = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(vidx), _mm256_castsi256_ps(cur), gt));
    cur = _mm256_add_epi32(cur, step);
  }
  alignas(32) float m[8];
  alignas(32) int32_t id[8];
  _mm256_store_ps(m, vmax);
  _mm256_store_si256(reinterpret_cast<__m256i*>(id), vidx);
  for (int l = 0; l < 8; ++l)  // the smallest index among the lanes holding the maximum
    if (m[l] > best || (m[l] == best && id[l] < arg)) best = m[l], arg = id[l];
#endif
  for (; i < n; ++i) {
    const float p = std::nearbyint(x[i] * scale) * inv_grid;
    x[i] = p;
    if (p > best) best = p, arg = i;
  }
  return {best, arg};
}

struct RowResult {
  float entropy;
  int64_t sample;
};

// Passes 2-3 on snapped logits p (max m): p <- softmax(p) in place; the entropy of it; the
// inverse-CDF sample at u in [0, 1): the first index whose prefix sum of exp(p - m) exceeds
// u * S. Sums in double (block sums of kBlock floats), so the search is exact to ~1e-12 of the
// total: a zero-probability token is never drawn, and rounding moves no sample noticeably.
RowResult softmax_sample_row(float* x, int64_t n, float m, float u, double* blocks) {
  const int64_t nb = (n + kBlock - 1) / kBlock;
  double total = 0.0, weighted = 0.0;  // S = sum e, sum e * (p - m)
  for (int64_t b = 0; b < nb; ++b) {
    float* v = x + b * kBlock;
    const int64_t len = std::min(kBlock, n - b * kBlock);
    float s[8] = {0, 0, 0, 0, 0, 0, 0, 0}, w[8] = {0, 0, 0, 0, 0, 0, 0, 0};  // 8 lanes: vectorizes
    int64_t i = 0;
    for (; i + 8 <= len; i += 8)
      for (int l = 0; l < 8; ++l) {
        const float d = v[i + l] - m;
        const float e = fast_exp(d);
        v[i + l] = e;
        s[l] += e;
        w[l] += e * d;
      }
    for (; i < len; ++i) {
      const float d = v[i] - m, e = fast_exp(d);
      v[i] = e;
      s[0] += e;
      w[0] += e * d;
    }
    double bs = 0.0, bw = 0.0;
    for (int l = 0; l < 8; ++l) bs += s[l], bw += w[l];
    blocks[b] = bs;
    total += bs;
    weighted += bw;
  }
  // Entropy of q = e / S with log q = (p - m) - log S:  H = log S - sum(e * (p - m)) / S.
  const float entropy = static_cast<float>(std::log(total) - weighted / total);

  const double target = static_cast<double>(u) * total;
  double prefix = 0.0;
  int64_t b = 0;
  while (b + 1 < nb && prefix + blocks[b] <= target) prefix += blocks[b++];
  int64_t sample = n - 1;  // only if rounding leaves the target past every prefix
  for (int64_t i = b * kBlock; i < n; ++i) {
    prefix += x[i];
    if (prefix > target) {
      sample = i;
      break;
    }
  }
  const float inv = static_cast<float>(1.0 / total);
  for (int64_t i = 0; i < n; ++i) x[i] *= inv;
  return {entropy, sample};
}

// logits [R, V] float32 (in place: becomes softmax of the snapped logits), scale [R] float32
// (grid / temperature per row), u [R] float32 uniforms -> (entropy [R] f32, sample [R] i64,
// argmax [R] i64). Row r's snapped logits are round(logits * scale[r]) / grid.
std::tuple<at::Tensor, at::Tensor, at::Tensor> denoise_rows(at::Tensor logits, const at::Tensor& scale,
                                                            const at::Tensor& u, double grid) {
  check_logits(logits);
  const int64_t rows = logits.size(0), n = logits.size(1), rs = logits.stride(0);
  TORCH_CHECK(n > 0, "empty vocabulary");
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.is_contiguous() && scale.numel() == rows,
              "scale must be float32 [rows]");
  TORCH_CHECK(u.scalar_type() == at::kFloat && u.is_contiguous() && u.numel() == rows, "u must be float32 [rows]");
  TORCH_CHECK(n < (int64_t{1} << 31), "vocabulary too large for 32-bit lane indices");
  at::Tensor ent = at::empty({rows}, logits.options());
  at::Tensor sample = at::empty({rows}, logits.options().dtype(at::kLong));
  at::Tensor argmax = at::empty({rows}, logits.options().dtype(at::kLong));
  float* base = logits.mutable_data_ptr<float>();
  const float* sc = scale.const_data_ptr<float>();
  const float* us = u.const_data_ptr<float>();
  float* e = ent.mutable_data_ptr<float>();
  int64_t* s = sample.mutable_data_ptr<int64_t>();
  int64_t* a = argmax.mutable_data_ptr<int64_t>();
  const float inv_grid = static_cast<float>(1.0 / grid);
  at::parallel_for(0, rows, 1, [&](int64_t r0, int64_t r1) {
    std::vector<double> blocks((n + kBlock - 1) / kBlock);
    for (int64_t r = r0; r < r1; ++r) {
      float* x = base + r * rs;
      const auto [m, arg] = snap_row(x, n, sc[r], inv_grid);
      const RowResult res = softmax_sample_row(x, n, m, us[r], blocks.data());
      e[r] = res.entropy;
      s[r] = res.sample;
      a[r] = arg;
    }
  });
  return {ent, sample, argmax};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(impasto, m) {
  m.def("softcap_(Tensor(a!) x, float cap) -> ()");
  m.def("denoise_rows(Tensor(a!) logits, Tensor scale, Tensor u, float grid) -> (Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(impasto, CPU, m) {
  m.impl("softcap_", &softcap_);
  m.impl("denoise_rows", &denoise_rows);
}
