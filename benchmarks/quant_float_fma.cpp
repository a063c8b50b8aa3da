// Dequantize-in-register float32 FMA kernels for Q8_0 and Q4_K: the alternative to impasto's
// integer dot products that benchmarks/quant_kernels.py measures. Not part of impasto.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <cstring>

#pragma pack(push, 1)
struct BlockQ8_0 { uint16_t d; int8_t qs[32]; };
struct BlockQ4_K { uint16_t d, dmin; uint8_t scales[12]; uint8_t qs[128]; };
#pragma pack(pop)

static inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_shuffle_ps(s, s, 1)));
}
static inline void scale_min(int j, const uint8_t* s, int& sc, int& m) {
  if (j < 4) { sc = s[j] & 63; m = s[j + 4] & 63; }
  else { sc = (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4); m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4); }
}
// 8 bytes -> 8 floats
static inline __m256 u8f(const uint8_t* p) { return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)p))); }
static inline __m256 s8f(const int8_t* p) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p))); }

template <int NX> void row_q8_0(const uint8_t* w, const float* const* x, int64_t nb, float* out) {
  const BlockQ8_0* b = (const BlockQ8_0*)w;
  __m256 acc[NX];
  for (int t = 0; t < NX; ++t) acc[t] = _mm256_setzero_ps();
  for (int64_t i = 0; i < nb; ++i) {
    const __m256 d = _mm256_set1_ps(_cvtsh_ss(b[i].d));
    __m256 wv[4];
    for (int k = 0; k < 4; ++k) wv[k] = _mm256_mul_ps(s8f(b[i].qs + 8 * k), d);
    for (int t = 0; t < NX; ++t)
      for (int k = 0; k < 4; ++k) acc[t] = _mm256_fmadd_ps(wv[k], _mm256_loadu_ps(x[t] + 32 * i + 8 * k), acc[t]);
  }
  for (int t = 0; t < NX; ++t) out[t] = hsum(acc[t]);
}

template <int NX> void row_q4_k(const uint8_t* w, const float* const* x, int64_t nb, float* out) {
  const BlockQ4_K* b = (const BlockQ4_K*)w;
  __m256 acc[NX];
  for (int t = 0; t < NX; ++t) acc[t] = _mm256_setzero_ps();
  alignas(32) uint8_t q[256];
  for (int64_t i = 0; i < nb; ++i) {
    const float d = _cvtsh_ss(b[i].d), dmin = _cvtsh_ss(b[i].dmin);
    for (int c = 0; c < 4; ++c) {  // unpack nibbles once per block
      const __m256i v = _mm256_loadu_si256((const __m256i*)(b[i].qs + 32 * c));
      _mm256_store_si256((__m256i*)(q + 64 * c), _mm256_and_si256(v, _mm256_set1_epi8(15)));
      _mm256_store_si256((__m256i*)(q + 64 * c + 32), _mm256_and_si256(_mm256_srli_epi16(v, 4), _mm256_set1_epi8(15)));
    }
    for (int j = 0; j < 8; ++j) {
      int sc, m;
      scale_min(j, b[i].scales, sc, m);
      const __m256 s = _mm256_set1_ps(d * sc), mn = _mm256_set1_ps(dmin * m);
      __m256 wv[4];
      for (int k = 0; k < 4; ++k) wv[k] = _mm256_fmsub_ps(u8f(q + 32 * j + 8 * k), s, mn);
      for (int t = 0; t < NX; ++t)
        for (int k = 0; k < 4; ++k)
          acc[t] = _mm256_fmadd_ps(wv[k], _mm256_loadu_ps(x[t] + 256 * i + 32 * j + 8 * k), acc[t]);
    }
  }
  for (int t = 0; t < NX; ++t) out[t] = hsum(acc[t]);
}

template <template <int> class> struct Tag {};
template <int NX> struct Q8 { static void run(const uint8_t* w, const float* const* x, int64_t nb, float* o) { row_q8_0<NX>(w, x, nb, o); } };
template <int NX> struct Q4K { static void run(const uint8_t* w, const float* const* x, int64_t nb, float* o) { row_q4_k<NX>(w, x, nb, o); } };

template <template <int> class K>
torch::Tensor run(torch::Tensor x, torch::Tensor w, int64_t elems) {
  x = x.contiguous().to(torch::kFloat);
  const int64_t rows = x.size(0), n = x.size(1), out_f = w.size(0), rb = w.size(1), nb = n / elems;
  auto y = torch::empty({rows, out_f}, x.options());
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const uint8_t* wp = w.data_ptr<uint8_t>();
  at::parallel_for(0, out_f, std::max<int64_t>(1, 32768 / rb), [&](int64_t lo, int64_t hi) {
    const float* xs[4];
    float res[4];
    for (int64_t t0 = 0; t0 < rows; t0 += 64) {
      const int64_t tn = std::min<int64_t>(64, rows - t0);
      for (int64_t o = lo; o < hi; ++o)
        for (int64_t t = t0; t < t0 + tn; t += 4) {
          const int64_t k = std::min<int64_t>(4, t0 + tn - t);
          for (int64_t i = 0; i < k; ++i) xs[i] = xp + (t + i) * n;
          if (k == 4) K<4>::run(wp + o * rb, xs, nb, res);
          else if (k == 3) K<3>::run(wp + o * rb, xs, nb, res);
          else if (k == 2) K<2>::run(wp + o * rb, xs, nb, res);
          else K<1>::run(wp + o * rb, xs, nb, res);
          for (int64_t i = 0; i < k; ++i) yp[(t + i) * out_f + o] = res[i];
        }
    }
  });
  return y;
}
torch::Tensor fma_q8_0(torch::Tensor x, torch::Tensor w) { return run<Q8>(x, w, 32); }
torch::Tensor fma_q4_k(torch::Tensor x, torch::Tensor w) { return run<Q4K>(x, w, 256); }

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("fma_q8_0", &fma_q8_0);
  m.def("fma_q4_k", &fma_q4_k);
}
