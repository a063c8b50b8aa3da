// Float32 math for the kernel sources of impasto/kernels: bf16 <-> float32 on raw bits, exp and
// tanh as plain arithmetic (no libm calls, so GCC vectorizes the loops that use them), and dot
// products with a fixed summation order (AVX2/FMA intrinsics where the CPU has them, the same
// order in plain C otherwise), so a dot's bits never depend on how many rows share its call.
#pragma once

#include <bit>
#include <cmath>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif
#include <cstdint>

namespace impasto_vec {

// bf16 values are handled as their raw bits (the high half of a float32): GCC vectorizes loops
// over uint16_t, not over c10::BFloat16 objects.
using bf16 = uint16_t;

inline float to_f(float x) { return x; }
inline float to_f(bf16 x) { return std::bit_cast<float>(static_cast<uint32_t>(x) << 16); }
template <typename T> inline T from_f(float x);
template <> inline float from_f<float>(float x) { return x; }
// Round to nearest even, branch-free so that loops storing bf16 vectorize; NaN stays NaN.
template <> inline bf16 from_f<bf16>(float x) {
  const uint32_t u = std::bit_cast<uint32_t>(x);
  const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  return static_cast<bf16>(x != x ? 0x7fc0u : rounded);
}

// A dot product with 8 lanes of partial sums (lane l: elements l, l + 8, ..., one fused
// multiply-add each), the lanes summed as ((0 + 4) + (1 + 5)) + ((2 + 6) + (3 + 7)), then any
// tail. dot4 does the same for 4 rows, bit for bit: 4 independent accumulator chains instead
// of one, so the FMAs' latency overlaps. Written with intrinsics where the CPU has FMA so that
// both compile to the same operations (the vectorizer treats the two loops differently).
#if defined(__AVX2__) && defined(__FMA__)
inline float lane_sum(__m256 c) {
  const __m128 x = _mm_add_ps(_mm256_castps256_ps128(c), _mm256_extractf128_ps(c, 1));  // (l, l + 4)
  const __m128 h = _mm_hadd_ps(x, x);  // (0 + 1), (2 + 3)
  return _mm_cvtss_f32(_mm_hadd_ps(h, h));
}
inline float dot(const float* a, const float* b, int64_t n) {
  __m256 acc = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
  float s = lane_sum(acc);
  for (; i < n; ++i) s = std::fma(a[i], b[i], s);
  return s;
}
inline void dot4(const float* a, const float* const* b, int64_t n, float* out) {
  __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 x = _mm256_loadu_ps(a + i);
    for (int j = 0; j < 4; ++j) acc[j] = _mm256_fmadd_ps(x, _mm256_loadu_ps(b[j] + i), acc[j]);
  }
  for (int j = 0; j < 4; ++j) {
    float s = lane_sum(acc[j]);
    for (int64_t t = i; t < n; ++t) s = std::fma(a[t], b[j][t], s);
    out[j] = s;
  }
}
#else
inline float dot(const float* a, const float* b, int64_t n) {
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (int l = 0; l < 8; ++l) acc[l] = std::fma(a[i + l], b[i + l], acc[l]);
  float s = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
  for (; i < n; ++i) s = std::fma(a[i], b[i], s);
  return s;
}
inline void dot4(const float* a, const float* const* b, int64_t n, float* out) {
  for (int j = 0; j < 4; ++j) out[j] = dot(a, b[j], n);
}
#endif

template <typename T> inline void load_row(const T* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = to_f(src[i]);
}

// exp: range reduction by ln 2 and a degree-6 polynomial (max relative error ~2e-7 on the
// clamped range, far below bf16's 4e-3). Below -87, where float's exp has no normal result, 0:
// a softmax weight that underflows is none (the sampler relies on it: such a token is never
// drawn), not the clamp's 1.6e-38.
inline float fast_exp(float x) {
  const bool underflow = x < -87.0f;
  x = underflow ? -87.0f : (x > 88.0f ? 88.0f : x);  // (fmin/fmax do not vectorize)
  // Round to nearest by adding and subtracting 1.5 * 2^23 (plain arithmetic, so it vectorizes;
  // std::nearbyint compiles to a libm call per element).
  constexpr float kRound = 12582912.0f;
  const float n = (x * 1.44269504088896341f + kRound) - kRound;
  const float r = (x - n * 0.693359375f) + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  return underflow ? 0.0f : p * std::bit_cast<float>((static_cast<int32_t>(n) + 127) << 23);
}

// tanh within a few ulp. |x| < 0.5: the odd Taylor series to x^15 (the first omitted term is
// below 1e-8 there, so no cancellation and no truncation error that matters); otherwise
// (1 - t) / (1 + t) with t = exp(-2|x|) <= e^-1, where neither subtraction nor division
// amplifies exp's error by more than ~1.6x. Beyond |x| = 9, t underflows float's precision: 1.
inline float fast_tanh(float x) {
  const float a = x < 0.0f ? -x : x;
  const float z = x * x;
  float s = -929569.0f / 638512875.0f;
  s = s * z + 21844.0f / 6081075.0f;
  s = s * z - 1382.0f / 155925.0f;
  s = s * z + 62.0f / 2835.0f;
  s = s * z - 17.0f / 315.0f;
  s = s * z + 2.0f / 15.0f;
  s = s * z - 1.0f / 3.0f;
  const float small = x + x * z * s;
  const float t = fast_exp(-2.0f * (a > 9.0f ? 9.0f : a));
  const float big = (1.0f - t) / (1.0f + t);
  return a < 0.5f ? small : (x < 0.0f ? -big : big);
}

}  // namespace impasto_vec
