// The packed matmul's kernels on GGML's row layout (weights as the file has them; quant_x8.cpp
// has those of the interleaved layout): one weight row against up to kNX activation rows at a
// time, the weight block decoded once for all of them. The driver (quant_ops.cpp) quantizes the
// activations and calls rows_run for a range of weight rows.
//
// Invariant (quant_ops.cpp's arithmetic): integer sums exact and equal on AVX2 and VNNI, widened
// to float once per block and accumulated block after block, so an output depends only on its
// weight row and its activation row, not on which rows share a pass or a tile.
#include "quant_rows.h"

#include <type_traits>

namespace impasto_quant {
namespace {

#ifdef IMPASTO_AVX2
// Each kernel: one weight row (nb blocks) against NX activation rows; out[t] = the dot product.
// Per block, acc[t] += (dw * dx) * lanes (8 floats, fused multiply-add); per-block offset terms
// (mins, and the -8 / -16 zero points) go to a float `off[t]`; the result is hsum - off. The
// weight block is decoded once for all NX rows.
template <int NX, typename Blk, typename Fn>
inline void blocks32(const uint8_t* wrow, const ActQ8* const* x, int64_t nb, float* out, Fn fn) {
  const Blk* w = reinterpret_cast<const Blk*>(wrow);
  __m256 acc[NX];
  float off[NX];
  for (int t = 0; t < NX; ++t) acc[t] = _mm256_setzero_ps(), off[t] = 0.0f;
  for (int64_t b = 0; b < nb; ++b) fn(w[b], b, x, acc, off);
  for (int t = 0; t < NX; ++t) out[t] = hsum(acc[t]) - off[t];
}
#endif

#ifdef IMPASTO_AVX2
template <int NX> struct Q4_0Dot {
  static void run(const uint8_t* w, const ActQ8* const* x, int64_t nb, float* out) {
    blocks32<NX, BlockQ4_0>(w, x, nb, out, [](const BlockQ4_0& blk, int64_t b, const ActQ8* const* xs, __m256* acc, float* off) {
      const __m256i q = nibbles(blk.qs);  // values + 8
      const float d = half_to_float(blk.d);
      for (int t = 0; t < NX; ++t) {
        const ActQ8& a = xs[t][b];
        const float s = d * a.d;
        acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot_lanes(q, load32(a.q))), _mm256_set1_ps(s), acc[t]);
        off[t] += d * (8.0f * a.dsum);
      }
    });
  }
};
template <int NX> struct Q4_1Dot {
  static void run(const uint8_t* w, const ActQ8* const* x, int64_t nb, float* out) {
    blocks32<NX, BlockQ4_1>(w, x, nb, out, [](const BlockQ4_1& blk, int64_t b, const ActQ8* const* xs, __m256* acc, float* off) {
      const __m256i q = nibbles(blk.qs);
      const float d = half_to_float(blk.d), m = half_to_float(blk.m);
      for (int t = 0; t < NX; ++t) {
        const ActQ8& a = xs[t][b];
        acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot_lanes(q, load32(a.q))), _mm256_set1_ps(d * a.d), acc[t]);
        off[t] -= m * a.msum;  // the min adds m * sum(x)
      }
    });
  }
};
template <int NX> struct Q5_0Dot {
  static void run(const uint8_t* w, const ActQ8* const* x, int64_t nb, float* out) {
    blocks32<NX, BlockQ5_0>(w, x, nb, out, [](const BlockQ5_0& blk, int64_t b, const ActQ8* const* xs, __m256* acc, float* off) {
      const __m256i q = _mm256_or_si256(nibbles(blk.qs), fifth_bits(blk.qh));  // values + 16
      const float d = half_to_float(blk.d);
      for (int t = 0; t < NX; ++t) {
        const ActQ8& a = xs[t][b];
        const float s = d * a.d;
        acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot_lanes(q, load32(a.q))), _mm256_set1_ps(s), acc[t]);
        off[t] += d * (16.0f * a.dsum);
      }
    });
  }
};
template <int NX> struct Q5_1Dot {
  static void run(const uint8_t* w, const ActQ8* const* x, int64_t nb, float* out) {
    blocks32<NX, BlockQ5_1>(w, x, nb, out, [](const BlockQ5_1& blk, int64_t b, const ActQ8* const* xs, __m256* acc, float* off) {
      const __m256i q = _mm256_or_si256(nibbles(blk.qs), fifth_bits(blk.qh));
      const float d = half_to_float(blk.d), m = half_to_float(blk.m);
      for (int t = 0; t < NX; ++t) {
        const ActQ8& a = xs[t][b];
        acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot_lanes(q, load32(a.q))), _mm256_set1_ps(d * a.d), acc[t]);
        off[t] -= m * a.msum;
      }
    });
  }
};
template <int NX> struct Q8_0Dot {
  static void run(const uint8_t* w, const ActQ8* const* x, int64_t nb, float* out) {
    blocks32<NX, BlockQ8_0>(w, x, nb, out, [](const BlockQ8_0& blk, int64_t b, const ActQ8* const* xs, __m256* acc, float* off) {
      // signed x signed: |w| as the unsigned operand, x with w's sign moved onto it
      const __m256i q = load32(blk.qs);
      const __m256i aq = _mm256_sign_epi8(q, q);
      const float d = half_to_float(blk.d);
      for (int t = 0; t < NX; ++t) {
        const ActQ8& a = xs[t][b];
        const __m256i sx = _mm256_sign_epi8(load32(a.q), q);
        acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot_lanes(aq, sx)), _mm256_set1_ps(d * a.d), acc[t]);
      }
      (void)off;
    });
  }
};

// K-quants: one super-block of 256 at a time. Per activation row, all integer work is vector:
// the sub-block scales multiply the dot lanes, and the mins (Q4_K / Q5_K) or the -32 zero
// point (Q6_K) meet the activations' 16-value sums in one madd.

// The 6-bit scales and mins of a Q4_K / Q5_K super-block's 8 sub-blocks, as bytes: sub-blocks
// 0-3 keep theirs in the low 6 bits of bytes 0-3 (scales) and 4-7 (mins); sub-blocks 4-7 take
// the low 4 bits from the nibbles of bytes 8-11 and the top 2 from the spare top bits above.
inline void k4_scales(const uint8_t* s, uint8_t (&sc)[8], uint8_t (&mn)[8]) {
  uint32_t a, b, c;
  std::memcpy(&a, s, 4);
  std::memcpy(&b, s + 4, 4);
  std::memcpy(&c, s + 8, 4);
  const uint32_t lo6 = 0x3F3F3F3Fu, lo4 = 0x0F0F0F0Fu, top2 = 0x30303030u;
  const uint32_t words[4] = {a & lo6, (c & lo4) | ((a >> 2) & top2), b & lo6, ((c >> 4) & lo4) | ((b >> 2) & top2)};
  std::memcpy(sc, words, 8);
  std::memcpy(mn, words + 2, 8);
}

// mins [8] bytes -> 16 int16: each min twice (it covers two 16-value groups).
inline __m256i k4_mins16(const uint8_t (&mn)[8]) {
  const __m128i m = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(mn));
  return _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(m, m));
}

inline __m256i load_bsums(const ActQ8K& a) { return load32(a.bsums); }

template <int NX, bool kFifthBit> struct QK45Dot {
  using Blk = std::conditional_t<kFifthBit, BlockQ5_K, BlockQ4_K>;
  static void run(const uint8_t* wrow, const ActQ8K* const* x, int64_t nb, float* out) {
    const Blk* w = reinterpret_cast<const Blk*>(wrow);
    __m256 acc[NX], accm[NX];
    for (int t = 0; t < NX; ++t) acc[t] = _mm256_setzero_ps(), accm[t] = _mm256_setzero_ps();
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    for (int64_t b = 0; b < nb; ++b) {
      const Blk& blk = w[b];
      uint8_t sc[8], mn[8];
      k4_scales(blk.scales, sc, mn);
      const __m256i mins = k4_mins16(mn);
      __m256i lo[4], hi[4];
      for (int c = 0; c < 4; ++c) {
        const __m256i q = load32(blk.qs + 32 * c);
        lo[c] = _mm256_and_si256(q, m4);
        hi[c] = _mm256_and_si256(_mm256_srli_epi16(q, 4), m4);
        if constexpr (kFifthBit) {  // bit 2c of qh[l]: value l of sub-block 2c; bit 2c+1: 2c+1
          const __m256i qh = load32(blk.qh), one = _mm256_set1_epi8(1);
          lo[c] = _mm256_or_si256(lo[c], _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * c), one), 4));
          hi[c] = _mm256_or_si256(hi[c], _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * c + 1), one), 4));
        }
      }
      const float d = half_to_float(blk.d), dmin = half_to_float(blk.dmin);
      for (int t = 0; t < NX; ++t) {
        const ActQ8K& a = x[t][b];
        __m256i isum = _mm256_setzero_si256();
        for (int c = 0; c < 4; ++c) {
          isum = _mm256_add_epi32(isum, dot_lanes_scaled(lo[c], load32(a.q + 64 * c), sc[2 * c], sc[2 * c]));
          isum = _mm256_add_epi32(isum, dot_lanes_scaled(hi[c], load32(a.q + 64 * c + 32), sc[2 * c + 1], sc[2 * c + 1]));
        }
        const __m256i msum = _mm256_madd_epi16(load_bsums(a), mins);  // min_j * sum(x of j)
        acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_set1_ps(d * a.d), acc[t]);
        accm[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(msum), _mm256_set1_ps(dmin * a.d), accm[t]);
      }
    }
    for (int t = 0; t < NX; ++t) out[t] = hsum(acc[t]) - hsum(accm[t]);
  }
};
template <int NX> using Q4_KDot = QK45Dot<NX, false>;
template <int NX> using Q5_KDot = QK45Dot<NX, true>;

template <int NX> struct Q6_KDot {
  static void run(const uint8_t* wrow, const ActQ8K* const* x, int64_t nb, float* out) {
    const BlockQ6_K* w = reinterpret_cast<const BlockQ6_K*>(wrow);
    __m256 acc[NX];
    for (int t = 0; t < NX; ++t) acc[t] = _mm256_setzero_ps();
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    for (int64_t b = 0; b < nb; ++b) {
      const BlockQ6_K& blk = w[b];
      __m256i q[8];  // values + 32, in order: 32 per vector
      for (int h = 0; h < 2; ++h) {
        const __m256i l0 = load32(blk.ql + 64 * h), l1 = load32(blk.ql + 64 * h + 32);
        const __m256i qh = load32(blk.qh + 32 * h);
        q[4 * h + 0] = _mm256_or_si256(_mm256_and_si256(l0, m4), two_bits(qh, 0));
        q[4 * h + 1] = _mm256_or_si256(_mm256_and_si256(l1, m4), two_bits(qh, 1));
        q[4 * h + 2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), m4), two_bits(qh, 2));
        q[4 * h + 3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), m4), two_bits(qh, 3));
      }
      const int8_t* sc = blk.scales;  // one per 16 values
      // 32 * scale_g as int16, for the zero point: sum over g of 32 * sc_g * sum(x of g)
      const __m256i sc32 = _mm256_slli_epi16(_mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sc))), 5);
      const float d = half_to_float(blk.d);
      for (int t = 0; t < NX; ++t) {
        const ActQ8K& a = x[t][b];
        __m256i isum = _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_madd_epi16(load_bsums(a), sc32));
        for (int v = 0; v < 8; ++v)
          isum = _mm256_add_epi32(isum, dot_lanes_scaled(q[v], load32(a.q + 32 * v), sc[2 * v], sc[2 * v + 1]));
        acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_set1_ps(d * a.d), acc[t]);
      }
    }
    for (int t = 0; t < NX; ++t) out[t] = hsum(acc[t]);
  }
};
#endif  // IMPASTO_AVX2

constexpr int kNX = 4;          // activation rows per weight-row pass (one weight decode each)
constexpr int64_t kTile = 64;   // activation rows kept hot while a thread's weight rows stream

template <template <int> class Dot, typename Act>
void run_rows(const uint8_t* w, int64_t row_bytes, int64_t o_lo, int64_t o_hi, const Act* acts, int64_t nb,
              int64_t rows, const Out& y, int64_t col0) {
  const Act* xs[kNX];
  float res[kNX];
  for (int64_t t0 = 0; t0 < rows; t0 += kTile) {
    const int64_t tn = std::min(kTile, rows - t0);
    for (int64_t o = o_lo; o < o_hi; ++o) {
      const uint8_t* wr = w + o * row_bytes;
      for (int64_t t = t0; t < t0 + tn; t += kNX) {
        const int64_t n = std::min<int64_t>(kNX, t0 + tn - t);
        for (int64_t i = 0; i < n; ++i) xs[i] = acts + (t + i) * nb;
        switch (n) {
          case 4: Dot<4>::run(wr, xs, nb, res); break;
          case 3: Dot<3>::run(wr, xs, nb, res); break;
          case 2: Dot<2>::run(wr, xs, nb, res); break;
          default: Dot<1>::run(wr, xs, nb, res); break;
        }
        for (int64_t i = 0; i < n; ++i) y.store(t + i, col0 + o, res[i]);
      }
    }
  }
}

}  // namespace

void rows_run(int64_t qtype, const uint8_t* w, int64_t row_bytes, int64_t o_lo, int64_t o_hi, const void* acts,
              int64_t nb, int64_t rows, const Out& y, int64_t col0) {
#ifdef IMPASTO_AVX2
  const auto* a32 = static_cast<const ActQ8*>(acts);
  const auto* a256 = static_cast<const ActQ8K*>(acts);
  switch (qtype) {
    case kQ4_0: run_rows<Q4_0Dot>(w, row_bytes, o_lo, o_hi, a32, nb, rows, y, col0); break;
    case kQ4_1: run_rows<Q4_1Dot>(w, row_bytes, o_lo, o_hi, a32, nb, rows, y, col0); break;
    case kQ5_0: run_rows<Q5_0Dot>(w, row_bytes, o_lo, o_hi, a32, nb, rows, y, col0); break;
    case kQ5_1: run_rows<Q5_1Dot>(w, row_bytes, o_lo, o_hi, a32, nb, rows, y, col0); break;
    case kQ8_0: run_rows<Q8_0Dot>(w, row_bytes, o_lo, o_hi, a32, nb, rows, y, col0); break;
    case kQ4_K: run_rows<Q4_KDot>(w, row_bytes, o_lo, o_hi, a256, nb, rows, y, col0); break;
    case kQ5_K: run_rows<Q5_KDot>(w, row_bytes, o_lo, o_hi, a256, nb, rows, y, col0); break;
    case kQ6_K: run_rows<Q6_KDot>(w, row_bytes, o_lo, o_hi, a256, nb, rows, y, col0); break;
    default: TORCH_CHECK(false, "quant_linear: no row-layout kernel for GGML type ", qtype);
  }
#else
  (void)qtype, (void)w, (void)row_bytes, (void)o_lo, (void)o_hi, (void)acts, (void)nb, (void)rows, (void)y, (void)col0;
  TORCH_CHECK(false, "quant_linear: this build has no integer dot-product kernels");
#endif
}

}  // namespace impasto_quant
