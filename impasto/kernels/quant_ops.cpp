// Matmuls and embedding lookups on packed GGML weights (see impasto/kernels/quant.py).
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
#include "quant_x8.h"

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <type_traits>
#include <vector>

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

// ---------------------------------------------------------------- dequantization (scalar)
// One row of `n` values to float32: embedding lookups, and the portable matmul path.
void dequant_row(int64_t qtype, const uint8_t* row, float* y, int64_t n) {
  switch (qtype) {
    case kQ4_0: case kQ4_1: case kQ5_0: case kQ5_1: {
      for (int64_t b = 0; b < n / 32; ++b) {
        float d, m = 0.0f;
        const uint8_t* qs;
        uint32_t qh = 0;
        int zero = 0;
        if (qtype == kQ4_0) {
          const auto& k = reinterpret_cast<const BlockQ4_0*>(row)[b];
          d = half_to_float(k.d), qs = k.qs, zero = 8;
        } else if (qtype == kQ4_1) {
          const auto& k = reinterpret_cast<const BlockQ4_1*>(row)[b];
          d = half_to_float(k.d), m = half_to_float(k.m), qs = k.qs;
        } else if (qtype == kQ5_0) {
          const auto& k = reinterpret_cast<const BlockQ5_0*>(row)[b];
          d = half_to_float(k.d), qs = k.qs, zero = 16;
          std::memcpy(&qh, k.qh, 4);
        } else {
          const auto& k = reinterpret_cast<const BlockQ5_1*>(row)[b];
          d = half_to_float(k.d), m = half_to_float(k.m), qs = k.qs;
          std::memcpy(&qh, k.qh, 4);
        }
        for (int i = 0; i < 16; ++i) {
          const int v0 = (qs[i] & 0xF) | (((qh >> i) & 1) << 4);
          const int v1 = (qs[i] >> 4) | (((qh >> (i + 16)) & 1) << 4);
          y[32 * b + i] = static_cast<float>(v0 - zero) * d + m;
          y[32 * b + i + 16] = static_cast<float>(v1 - zero) * d + m;
        }
      }
      return;
    }
    case kQ8_0:
      for (int64_t b = 0; b < n / 32; ++b) {
        const auto& k = reinterpret_cast<const BlockQ8_0*>(row)[b];
        const float d = half_to_float(k.d);
        for (int i = 0; i < 32; ++i) y[32 * b + i] = static_cast<float>(k.qs[i]) * d;
      }
      return;
    case kQ4_K: case kQ5_K:
      for (int64_t b = 0; b < n / 256; ++b) {
        const uint8_t *scales, *qs, *qh = nullptr;
        float d, dmin;
        if (qtype == kQ4_K) {
          const auto& k = reinterpret_cast<const BlockQ4_K*>(row)[b];
          d = half_to_float(k.d), dmin = half_to_float(k.dmin), scales = k.scales, qs = k.qs;
        } else {
          const auto& k = reinterpret_cast<const BlockQ5_K*>(row)[b];
          d = half_to_float(k.d), dmin = half_to_float(k.dmin), scales = k.scales, qs = k.qs, qh = k.qh;
        }
        float* yb = y + 256 * b;
        for (int j = 0; j < 8; ++j) {
          int sc, mn;
          scale_min_k4(j, scales, sc, mn);
          const float ds = d * sc, dm = dmin * mn;
          const uint8_t* q = qs + 32 * (j / 2);
          for (int l = 0; l < 32; ++l) {
            int v = j % 2 == 0 ? q[l] & 0xF : q[l] >> 4;
            if (qh != nullptr) v |= ((qh[l] >> j) & 1) << 4;
            yb[32 * j + l] = ds * static_cast<float>(v) - dm;
          }
        }
      }
      return;
    case kQ6_K:
      for (int64_t b = 0; b < n / 256; ++b) {
        const auto& k = reinterpret_cast<const BlockQ6_K*>(row)[b];
        const float d = half_to_float(k.d);
        for (int h = 0; h < 2; ++h) {
          const uint8_t* ql = k.ql + 64 * h;
          const uint8_t* qh = k.qh + 32 * h;
          const int8_t* sc = k.scales + 8 * h;
          float* yh = y + 256 * b + 128 * h;
          for (int l = 0; l < 32; ++l) {
            const int v[4] = {(ql[l] & 0xF) | (((qh[l] >> 0) & 3) << 4), (ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4),
                              (ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4), (ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)};
            for (int s = 0; s < 4; ++s) {
              const int i = l + 32 * s;
              yh[i] = d * static_cast<float>(sc[i / 16]) * static_cast<float>(v[s] - 32);
            }
          }
        }
      }
      return;
    default: TORCH_CHECK(false, "packed weights: unsupported GGML type ", qtype);
  }
}

// ---------------------------------------------------------------- the matmul driver
constexpr int kNX = 4;          // activation rows per weight-row pass (one weight decode each)
constexpr int64_t kTile = 64;   // activation rows kept hot while a thread's weight rows stream

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

// Portable path: dequantize one weight row at a time, float dot products with x.
void run_rows_portable(int64_t qtype, const uint8_t* w, int64_t row_bytes, int64_t o_lo, int64_t o_hi,
                       const float* xf, int64_t rows, int64_t n, const Out& y, int64_t col0) {
  std::vector<float> wr(n);
  for (int64_t o = o_lo; o < o_hi; ++o) {
    dequant_row(qtype, w + o * row_bytes, wr.data(), n);
    for (int64_t t = 0; t < rows; ++t) {
      float s = 0.0f;
      for (int64_t i = 0; i < n; ++i) s += xf[t * n + i] * wr[i];
      y.store(t, col0 + o, s);
    }
  }
}

}  // namespace

at::Tensor linear_segments(const at::Tensor& x_in, const std::vector<at::Tensor>& blocks,
                           const std::vector<int64_t>& qtypes, const std::optional<at::Tensor>& bias) {
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
    TORCH_CHECK(ti.elems > 0 && (!x8 || x8_supported(qt)), "quant_linear: unsupported GGML type ", qtypes[s]);
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
  Out out;
  out.stride = out_f;
  if (x.scalar_type() == at::kBFloat16) {
    out.bf16 = y.mutable_data_ptr<c10::BFloat16>();
    if (bias.has_value()) out.bias_bf16 = bias->const_data_ptr<c10::BFloat16>();
  } else {
    out.f32 = y.mutable_data_ptr<float>();
    if (bias.has_value()) out.bias_f32 = bias->const_data_ptr<float>();
  }
#ifdef IMPASTO_AVX2
  Acts acts;
  bool have32 = false, have256 = false;
#else
  std::vector<float> xf(rows * n);
  for (int64_t t = 0; t < rows; ++t)
    for (int64_t i = 0; i < n; ++i)
      xf[t * n + i] = x.scalar_type() == at::kBFloat16 ? static_cast<float>(x.const_data_ptr<c10::BFloat16>()[t * x.stride(0) + i])
                                                        : x.const_data_ptr<float>()[t * x.stride(0) + i];
#endif
  int64_t col0 = 0;
  for (size_t s = 0; s < blocks.size(); ++s) {
    const bool x8 = (qtypes[s] & kX8Flag) != 0;
    const int64_t qt = qtypes[s] & ~kX8Flag, row_bytes = blocks[s].size(1);
    const int64_t seg_rows = x8 ? 8 * blocks[s].size(0) : blocks[s].size(0);
    const uint8_t* w = blocks[s].const_data_ptr<uint8_t>();
    // At least ~32 KiB of weight passes per task (a weight row is read once per 4-5 activation
    // rows): below that a second thread costs more than it saves.
    const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(row_bytes * ((rows + 3) / 4), 1));
#ifdef IMPASTO_AVX2
    const bool k = type_info(qt).k;
    if (k && !have256) fill_acts(x, true, acts), have256 = true;
    if (!k && !have32) fill_acts(x, false, acts), have32 = true;
    if (x8) {
      const void* a = k ? static_cast<const void*>(acts.q8k.data()) : static_cast<const void*>(acts.q8.data());
      const int64_t nb = k ? acts.blocks256 : acts.blocks32;
      at::parallel_for(0, blocks[s].size(0), grain, [&](int64_t lo, int64_t hi) {
        x8_run(qt, w, row_bytes, lo, hi, a, nb, rows, out, col0);
      });
      col0 += seg_rows;
      continue;
    }
    at::parallel_for(0, seg_rows, grain, [&](int64_t lo, int64_t hi) {
      switch (qt) {
        case kQ4_0: run_rows<Q4_0Dot>(w, row_bytes, lo, hi, acts.q8.data(), acts.blocks32, rows, out, col0); break;
        case kQ4_1: run_rows<Q4_1Dot>(w, row_bytes, lo, hi, acts.q8.data(), acts.blocks32, rows, out, col0); break;
        case kQ5_0: run_rows<Q5_0Dot>(w, row_bytes, lo, hi, acts.q8.data(), acts.blocks32, rows, out, col0); break;
        case kQ5_1: run_rows<Q5_1Dot>(w, row_bytes, lo, hi, acts.q8.data(), acts.blocks32, rows, out, col0); break;
        case kQ8_0: run_rows<Q8_0Dot>(w, row_bytes, lo, hi, acts.q8.data(), acts.blocks32, rows, out, col0); break;
        case kQ4_K: run_rows<Q4_KDot>(w, row_bytes, lo, hi, acts.q8k.data(), acts.blocks256, rows, out, col0); break;
        case kQ5_K: run_rows<Q5_KDot>(w, row_bytes, lo, hi, acts.q8k.data(), acts.blocks256, rows, out, col0); break;
        case kQ6_K: run_rows<Q6_KDot>(w, row_bytes, lo, hi, acts.q8k.data(), acts.blocks256, rows, out, col0); break;
        default: break;
      }
    });
#else
    at::parallel_for(0, seg_rows, grain, [&](int64_t lo, int64_t hi) {
      run_rows_portable(qt, w, row_bytes, lo, hi, xf.data(), rows, n, out, col0);
    });
#endif
    col0 += seg_rows;
  }
  return y;
}

namespace {

// Any leading shape: [..., I] -> [..., O].
at::Tensor quant_linear(const at::Tensor& x, at::TensorList blocks, at::IntArrayRef qtypes,
                        const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() >= 1, "quant_linear: x must have at least one dimension");
  const std::vector<at::Tensor> segs(blocks.begin(), blocks.end());
  const std::vector<int64_t> types(qtypes.begin(), qtypes.end());
  const at::Tensor rows = x.dim() == 2 && x.stride(1) == 1 ? x : x.contiguous().reshape({-1, x.size(-1)});
  auto y = linear_segments(rows, segs, types, bias);
  auto shape = x.sizes().vec();
  shape.back() = y.size(1);
  return y.view(shape);
}

// Rows `ids` of a packed [V, H] table, dequantized to `dtype` (float32 or bfloat16).
at::Tensor quant_embedding(const at::Tensor& ids, const at::Tensor& blocks, int64_t qtype, int64_t cols,
                           at::ScalarType dtype) {
  const TypeInfo ti = type_info(qtype);
  TORCH_CHECK(blocks.scalar_type() == at::kByte && blocks.dim() == 2 && blocks.is_contiguous() &&
                  cols % ti.elems == 0 && blocks.size(1) == cols / ti.elems * ti.bytes,
              "quant_embedding: blocks must be contiguous uint8 [V, row_bytes] for ", cols, " columns");
  TORCH_CHECK(ids.scalar_type() == at::kLong && ids.dim() == 1, "quant_embedding: ids must be int64 [T]");
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "quant_embedding: float32 or bfloat16 output");
  const at::Tensor idc = ids.contiguous();
  const int64_t t = idc.size(0), vocab = blocks.size(0);
  const int64_t* ip = idc.const_data_ptr<int64_t>();
  for (int64_t i = 0; i < t; ++i) TORCH_CHECK(ip[i] >= 0 && ip[i] < vocab, "quant_embedding: token id out of range");
  auto out = at::empty({t, cols}, blocks.options().dtype(dtype));
  const uint8_t* w = blocks.const_data_ptr<uint8_t>();
  at::parallel_for(0, t, 16, [&](int64_t lo, int64_t hi) {
    std::vector<float> buf(cols);
    for (int64_t i = lo; i < hi; ++i) {
      dequant_row(qtype, w + ip[i] * blocks.size(1), buf.data(), cols);
      if (dtype == at::kFloat) std::copy(buf.begin(), buf.end(), out.mutable_data_ptr<float>() + i * cols);
      else {
        c10::BFloat16* o = out.mutable_data_ptr<c10::BFloat16>() + i * cols;
        for (int64_t j = 0; j < cols; ++j) o[j] = c10::BFloat16(buf[j]);
      }
    }
  });
  return out;
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
  m.def("quant_repack(Tensor blocks, int qtype) -> Tensor");
  m.def("quant_embedding(Tensor ids, Tensor blocks, int qtype, int cols, ScalarType dtype) -> Tensor");
  m.def("quant_isa() -> str", &impasto_quant::quant_isa);
  m.def("quant_repackable(int qtype) -> bool", &impasto_quant::quant_repackable);
}

TORCH_LIBRARY_IMPL(impasto, CPU, m) {
  m.impl("quant_linear", &impasto_quant::quant_linear);
  m.impl("quant_embedding", &impasto_quant::quant_embedding);
  m.impl("quant_repack", &impasto_quant::quant_repack);
}
