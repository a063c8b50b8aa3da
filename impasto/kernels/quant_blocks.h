// Shared by the packed-weight kernels (quant_rows.cpp: GGML's row layout; quant_x8.cpp: rows
// interleaved in groups of 8), their driver (quant_ops.cpp) and the scalar dequantization
// (quant_dequant.cpp): GGML's block formats, the 8-bit activation blocks both layouts meet, the
// integer dot-product building blocks, and where results go.
//
// Invariant: every integer dot product here is exact (no saturation for any input the callers
// pass), so the AVX2 and VNNI paths produce the same bits.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>

#if defined(__AVX2__) && defined(__FMA__) || defined(__F16C__)
#include <immintrin.h>
#endif
#if defined(__AVX2__) && defined(__FMA__)
#define IMPASTO_AVX2 1
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace impasto_quant {

// ---------------------------------------------------------------- formats
enum QType : int64_t { kQ4_0 = 2, kQ4_1 = 3, kQ5_0 = 6, kQ5_1 = 7, kQ8_0 = 8, kQ4_K = 12, kQ5_K = 13, kQ6_K = 14 };

#pragma pack(push, 1)
struct BlockQ4_0 { uint16_t d; uint8_t qs[16]; };
struct BlockQ4_1 { uint16_t d, m; uint8_t qs[16]; };
struct BlockQ5_0 { uint16_t d; uint8_t qh[4]; uint8_t qs[16]; };
struct BlockQ5_1 { uint16_t d, m; uint8_t qh[4]; uint8_t qs[16]; };
struct BlockQ8_0 { uint16_t d; int8_t qs[32]; };
struct BlockQ4_K { uint16_t d, dmin; uint8_t scales[12]; uint8_t qs[128]; };
struct BlockQ5_K { uint16_t d, dmin; uint8_t scales[12]; uint8_t qh[32]; uint8_t qs[128]; };
struct BlockQ6_K { uint8_t ql[128]; uint8_t qh[64]; int8_t scales[16]; uint16_t d; };
#pragma pack(pop)
static_assert(sizeof(BlockQ4_0) == 18 && sizeof(BlockQ4_1) == 20 && sizeof(BlockQ5_0) == 22);
static_assert(sizeof(BlockQ5_1) == 24 && sizeof(BlockQ8_0) == 34 && sizeof(BlockQ4_K) == 144);
static_assert(sizeof(BlockQ5_K) == 176 && sizeof(BlockQ6_K) == 210);

// Quantized activations, rounded as llama.cpp rounds its own (Q8_0 / Q8_1 / Q8_K blocks), so
// that a packed model computes what llama.cpp computes on the same file, not merely something
// as close to the float result. 32-blocks: q = round(x * 127 / amax), `d` = amax / 127 rounded
// to a half float (llama.cpp stores it so), `dsum` = d * (sum of q) (exact in float32: an 11-bit
// mantissa times |sum| < 2^12), for the Q4_0 / Q5_0 zero points, and `msum` = (amax / 127) *
// (sum of q) rounded to a half float (Q8_1's `s`), which the Q4_1 / Q5_1 mins multiply.
// K: d * q ~ x over 256 values with d = 1 / (127 / amax) in float32, bsums[g] = sum of
// q[16 g .. 16 g + 15], sums32[j] = bsums[2 j] + bsums[2 j + 1] (the interleaved kernels' mins,
// quant_x8.cpp), and pairs = q rearranged for the AVX-512 interleaved kernels: per 64 values c,
// 8 bytes g = (q[64 c + 4 g ..] 4 bytes, q[64 c + 32 + 4 g ..] 4 bytes) (quant_x8_avx512.h).
struct ActQ8 { float d; float dsum; float msum; int8_t q[32]; };
struct ActQ8K { float d; int16_t bsums[16]; int8_t q[256]; int16_t sums32[8]; int8_t pairs[256]; };

#if defined(__F16C__)
inline float half_to_float(uint16_t h) { return _cvtsh_ss(h); }  // one instruction
// v rounded to the nearest half float (ties to even), back in float32.
inline float round_half(float v) { return _cvtsh_ss(_cvtss_sh(v, _MM_FROUND_TO_NEAREST_INT)); }
#else
inline float half_to_float(uint16_t h) { return static_cast<float>(c10::Half(h, c10::Half::from_bits())); }
inline float round_half(float v) { return static_cast<float>(c10::Half(v)); }
#endif

struct TypeInfo { int64_t elems, bytes; bool k; };
inline TypeInfo type_info(int64_t qtype) {
  switch (qtype) {
    case kQ4_0: return {32, sizeof(BlockQ4_0), false};
    case kQ4_1: return {32, sizeof(BlockQ4_1), false};
    case kQ5_0: return {32, sizeof(BlockQ5_0), false};
    case kQ5_1: return {32, sizeof(BlockQ5_1), false};
    case kQ8_0: return {32, sizeof(BlockQ8_0), false};
    case kQ4_K: return {256, sizeof(BlockQ4_K), true};
    case kQ5_K: return {256, sizeof(BlockQ5_K), true};
    case kQ6_K: return {256, sizeof(BlockQ6_K), true};
    default: TORCH_CHECK(false, "packed weights: unsupported GGML type ", qtype);
  }
}

// The 6-bit scale and min of sub-block j (0..7) of a Q4_K / Q5_K super-block.
inline void scale_min_k4(int j, const uint8_t* s, int& sc, int& m) {
  if (j < 4) {
    sc = s[j] & 63;
    m = s[j + 4] & 63;
  } else {
    sc = (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4);
    m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

// ---------------------------------------------------------------- activation quantization
// Round to nearest even (the default rounding mode), as llama.cpp's vector conversion does. It
// must round the float32 product x * id, not the exact one: the old "add 1.5 * 2^23" trick let
// -ffp-contract=fast fuse the multiply into an FMA, which rounds ties of the product differently.
// nearbyint cannot be fused and GCC still vectorizes it (vroundps).
inline float round_even(float v) { return std::nearbyint(v); }

inline float abs_max(const float* x, int64_t n) {
  float m = 0.0f;
  for (int64_t i = 0; i < n; ++i) m = std::max(m, std::fabs(x[i]));
  return m;
}

inline void quantize_q8(const float* x, int64_t n, ActQ8* out) {
  for (int64_t b = 0; b < n / 32; ++b) {
    const float* xb = x + 32 * b;
    const float amax = abs_max(xb, 32);
    const float id = amax > 0.0f ? 127.0f / amax : 0.0f;
    int32_t sum = 0;
    for (int i = 0; i < 32; ++i) {
      const int v = static_cast<int>(round_even(xb[i] * id));
      out[b].q[i] = static_cast<int8_t>(v);
      sum += v;
    }
    const float d = amax / 127.0f;
    out[b].d = round_half(d);
    out[b].dsum = out[b].d * static_cast<float>(sum);
    out[b].msum = round_half(d * static_cast<float>(sum));
  }
}

inline void quantize_q8k(const float* x, int64_t n, ActQ8K* out) {
  for (int64_t b = 0; b < n / 256; ++b) {
    const float* xb = x + 256 * b;
    const float amax = abs_max(xb, 256);
    const float id = amax > 0.0f ? 127.0f / amax : 0.0f;
    for (int i = 0; i < 256; ++i) out[b].q[i] = static_cast<int8_t>(static_cast<int>(round_even(xb[i] * id)));
    for (int g = 0; g < 16; ++g) {
      int s = 0;
      for (int i = 0; i < 16; ++i) s += out[b].q[16 * g + i];
      out[b].bsums[g] = static_cast<int16_t>(s);
    }
    for (int j = 0; j < 8; ++j) out[b].sums32[j] = static_cast<int16_t>(out[b].bsums[2 * j] + out[b].bsums[2 * j + 1]);
    out[b].d = amax > 0.0f ? 1.0f / id : 0.0f;  // llama.cpp's 1 / iscale, not amax / 127
    for (int c = 0; c < 4; ++c)
      for (int g = 0; g < 8; ++g) {
        std::memcpy(out[b].pairs + 64 * c + 8 * g, out[b].q + 64 * c + 4 * g, 4);
        std::memcpy(out[b].pairs + 64 * c + 8 * g + 4, out[b].q + 64 * c + 32 + 4 * g, 4);
      }
  }
}

// ---------------------------------------------------------------- integer dot products
#ifdef IMPASTO_AVX2
// 8 int32 lanes, lane k = sum of u[4k + i] * s[4k + i], i < 4 (u unsigned, s signed bytes).
// VNNI does it in one instruction; AVX2 in two (maddubs's int16 pair sums cannot saturate:
// |u| <= 128 and |s| <= 127 in every caller, except Q8_0 where u = |w| <= 128 and the pair sum
// is at most 2 * 128 * 127 = 32512). Both give the same lanes.
inline __m256i dot_lanes(__m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#elif defined(__AVXVNNI__)
  return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, s);
#else
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

// acc + dot_lanes(u, s) (VNNI accumulates in the same instruction).
inline __m256i dot_acc(__m256i acc, __m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(acc, u, s);
#elif defined(__AVXVNNI__)
  return _mm256_dpbusd_avx_epi32(acc, u, s);
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
#endif
}

// Without VNNI a dot product is two multiplies (maddubs to int16 pairs, madd to int32). Where a
// caller's bounds keep a sum of several maddubs results within int16 (each pair sum is at most
// 2 * max|u| * 127: 3,810 for 4-bit u, 7,874 for 5-bit, 16,002 for 6-bit), it adds them in
// int16 and widens once, by madd with the sub-block's scale or with ones: half the multiplies,
// and the integer sums are exactly those of dot_acc.
#if defined(__AVX512VNNI__) && defined(__AVX512VL__) || defined(__AVXVNNI__)
constexpr bool kSum16 = false;
#else
constexpr bool kSum16 = true;
#endif
inline __m256i pairs16(__m256i u, __m256i s) { return _mm256_maddubs_epi16(u, s); }
inline __m256i widen16(__m256i v) { return _mm256_madd_epi16(v, _mm256_set1_epi16(1)); }
// int32 lanes (x, x) -> int16 pairs (x, x): a per-lane scale for madd.
inline __m256i scale_pairs(__m256i lanes32) { return _mm256_or_si256(lanes32, _mm256_slli_epi32(lanes32, 16)); }

// A sub-block's running sum of 4-bit products (int16 pairs without VNNI, int32 lanes with it),
// and that sum times per-lane int32 scales, as int32 lanes.
inline __m256i sub_acc(__m256i acc, __m256i u, __m256i s) {
  if constexpr (kSum16) return _mm256_add_epi16(acc, pairs16(u, s));
  else return dot_acc(acc, u, s);
}
inline __m256i sub_scaled(__m256i acc, __m256i scales32) {
  if constexpr (kSum16) return _mm256_madd_epi16(acc, scale_pairs(scales32));
  else return _mm256_mullo_epi32(acc, scales32);
}

// As dot_lanes, lanes 0-3 (values 0-15) times `a`, lanes 4-7 (values 16-31) times `b`.
inline __m256i dot_lanes_scaled(__m256i u, __m256i s, int a, int b) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__) || defined(__AVXVNNI__)
  return _mm256_mullo_epi32(dot_lanes(u, s), _mm256_set_m128i(_mm_set1_epi32(b), _mm_set1_epi32(a)));
#else
  const __m256i scale = _mm256_set_m128i(_mm_set1_epi16(static_cast<int16_t>(b)), _mm_set1_epi16(static_cast<int16_t>(a)));
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), scale);
#endif
}

// Keeps `v` in a register at this point. Without it GCC re-associates a chain of integer adds
// into a tree and parks every maddubs result on the stack until the tree's sums (a store and a
// reload per product): measured 2x slower on AVX2 at 4 activation rows.
inline void pin(__m256i& v) { asm("" : "+x"(v)); }

inline __m256i load32(const void* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }

// 16 bytes of nibble pairs -> 32 bytes: low nibbles (values 0-15), then high nibbles (16-31).
inline __m256i nibbles(const uint8_t* p) {
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(b, 4), b), _mm256_set1_epi8(0x0F));
}

// Bit j of a 32-bit word -> byte j = 0x10 (set) or 0 (the fifth bit of Q5 values).
inline __m256i fifth_bits(const uint8_t* qh) {
  uint32_t bits;
  std::memcpy(&bits, qh, 4);
  const __m256i spread = _mm256_setr_epi64x(0, 0x0101010101010101LL, 0x0202020202020202LL, 0x0303030303030303LL);
  const __m256i bytes = _mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int>(bits)), spread);
  const __m256i sel = _mm256_set1_epi64x(static_cast<long long>(0x8040201008040201ULL));
  const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(bytes, sel), sel);
  return _mm256_and_si256(set, _mm256_set1_epi8(0x10));
}

// Per 2-bit field k (0..3) of each byte of `v`: ((v >> 2k) & 3) << 4 (Q6_K's high bits).
inline __m256i two_bits(__m256i v, int k) {
  const __m256i f = _mm256_and_si256(_mm256_srli_epi16(v, 2 * k), _mm256_set1_epi8(3));
  return _mm256_slli_epi16(f, 4);
}

inline float hsum(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 h = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(h, _mm_shuffle_ps(h, h, 1)));
}
#endif

// Where results go: y[t * stride + col], plus the bias, rounded once to y's dtype.
struct Out {
  float* f32 = nullptr;
  c10::BFloat16* bf16 = nullptr;
  const float* bias_f32 = nullptr;
  const c10::BFloat16* bias_bf16 = nullptr;
  int64_t stride = 0;

  void store(int64_t t, int64_t col, float v) const {
    if (bias_f32 != nullptr) v += bias_f32[col];
    if (bias_bf16 != nullptr) v += static_cast<float>(bias_bf16[col]);
    if (f32 != nullptr) f32[t * stride + col] = v;
    else bf16[t * stride + col] = c10::BFloat16(v);
  }
};

}  // namespace impasto_quant
