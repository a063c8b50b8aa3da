// Packed GGML weights with rows interleaved in groups of 8: the layout the matmul computes on
// once a weight has been repacked (once, when the kernels are installed; impasto/models/layers/
// quantized.py), for Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K and Q6_K.
//
// Why: in GGML's row layout a dot product of one weight row with one activation row ends in 8
// int32 lanes that each hold part of the same sum, so every 32 values cost an integer multiply
// by the sub-block's scale and the end of every row a horizontal sum. Here the 8 int32 lanes of
// a vector are 8 different weight rows: 4 consecutive weight bytes of each row sit side by side,
// the activations' matching 4 bytes are broadcast to all lanes, and one dpbusd (or AVX2's
// maddubs + madd) advances 8 rows at once. A sub-block's scales then multiply 8 rows' sums in
// one instruction per sub-block, and the lanes are the 8 outputs: no horizontal sums.
//
// Layout: a group's blocks in order; one record per (group, block) holding each GGML field of
// the 8 rows, field by field (quant_x8_layout.h). Scales stay IEEE halves and the quants keep their
// bits. Q6_K's and Q5_x's high bits are
// regrouped so each 4-byte lane group decodes with shifts and masks only. A record is 8 GGML
// blocks' bytes, rearranged, except Q4_K's, whose 6-bit scales and mins are unpacked to bytes
// (+32 bytes a record, 2.8 %: read once per block, they would cost more unpacked per row).
//
// Arithmetic: as quant_ops.cpp's (8-bit activation blocks, exact integer sums, one float
// fused multiply-add per block and row in block order), so a row's result depends only on its
// weight row and activation row: batch invariance holds, and AVX2 and VNNI agree bit for bit.
// The per-block float terms are grouped differently from the row-layout kernels, so the two
// layouts agree to float rounding, not bit for bit; a model uses one of them for all its steps.
#include "quant_x8.h"

#include <type_traits>

#include "quant_x8_layout.h"

namespace impasto_quant {
namespace {
using namespace x8;

#ifdef IMPASTO_AVX2
// ---------------------------------------------------------------- kernels
// Each: NX activation rows against one group of 8 weight rows; acc[t] lane r += the block's
// contribution to output (t, r), block after block.

inline __m256i bcast4(const int8_t* p) {  // 4 activation bytes to every lane
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}
inline __m256i bcast4(const int16_t* p) { return bcast4(reinterpret_cast<const int8_t*>(p)); }
inline __m256 halves(const uint16_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }

// ((v >> s) & mask) for a compile-time shift that may be negative (a left shift), per byte:
// the mask keeps only bits that came from the same byte.
template <int S>
inline __m256i shift_bits(__m256i v, uint8_t mask) {
  const __m256i m = _mm256_set1_epi8(static_cast<char>(mask));
  if constexpr (S > 0) return _mm256_and_si256(_mm256_srli_epi16(v, S), m);
  else if constexpr (S < 0) return _mm256_and_si256(_mm256_slli_epi16(v, -S), m);
  else return _mm256_and_si256(v, m);
}

// A thread's groups are one contiguous stream; at one activation row the kernels wait on it, so
// each block asks for the bytes kAheadBytes further on (a later block, or the next group's).
// Measured on AVX2 (2 threads, alternating runs): batch-1 decode +10 % on Qwen2.5-1.5B Q4_K_M,
// +7 % on SmolLM2 Q4_1; 512-4096 bytes all help, 2048 the most.
constexpr int64_t kAheadBytes = 2048;
template <typename X>
inline void prefetch_ahead(const X& blk) {
  const char* p = reinterpret_cast<const char*>(&blk) + kAheadBytes;
  for (size_t off = 0; off < sizeof(X); off += 64) _mm_prefetch(p + off, _MM_HINT_T0);
}

enum class Zero { kNone, k8, k16, kMin };  // Q8_0 | Q4_0 | Q5_0 | Q4_1, Q5_1

template <int NX, typename X, Zero kZero, bool kFifth>
struct Dot32 {
  static void run(const uint8_t* wg, const ActQ8* const* x, int64_t nb, __m256* acc) {
    const X* w = reinterpret_cast<const X*>(wg);
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    for (int64_t b = 0; b < nb; ++b) {
      const X& blk = w[b];
      prefetch_ahead(blk);
      __m256i ia[NX];
      for (int t = 0; t < NX; ++t) ia[t] = _mm256_setzero_si256();
      if constexpr (std::is_same_v<X, X8Q8_0>) {
        for (int g = 0; g < 8; ++g) {  // signed x signed: |w| meets x carrying w's sign
          const __m256i v = load32(blk.qs[g]), u = _mm256_sign_epi8(v, v);
          for (int t = 0; t < NX; ++t) ia[t] = dot_acc(ia[t], u, _mm256_sign_epi8(bcast4(x[t][b].q + 4 * g), v)), pin(ia[t]);
        }
      } else if constexpr (kSum16) {
        // 4 groups x (low, high) of 4-bit values: 8 maddubs sums <= 30,480 in int16; 5-bit
        // values: the lows and the highs in two sums (4 x 7,874 each).
        [[maybe_unused]] __m256i qh;
        if constexpr (kFifth) qh = load32(blk.qh);
        __m256i s16[NX], h16[NX];
        for (int t = 0; t < NX; ++t) s16[t] = h16[t] = _mm256_setzero_si256();
        auto group = [&]<int G>() __attribute__((always_inline)) {
          const __m256i v = load32(blk.qs[G]);
          __m256i lo = _mm256_and_si256(v, m4), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
          if constexpr (kFifth) {
            lo = _mm256_or_si256(lo, shift_bits<2 * G - 4>(qh, 0x10));
            hi = _mm256_or_si256(hi, shift_bits<2 * G + 1 - 4>(qh, 0x10));
          }
          for (int t = 0; t < NX; ++t) {
            const int8_t* q = x[t][b].q + 4 * G;
            s16[t] = _mm256_add_epi16(s16[t], pairs16(lo, bcast4(q)));
            if constexpr (kFifth) h16[t] = _mm256_add_epi16(h16[t], pairs16(hi, bcast4(q + 16))), pin(h16[t]);
            else s16[t] = _mm256_add_epi16(s16[t], pairs16(hi, bcast4(q + 16)));
            pin(s16[t]);
          }
        };
        group.template operator()<0>();
        group.template operator()<1>();
        group.template operator()<2>();
        group.template operator()<3>();
        for (int t = 0; t < NX; ++t) {
          ia[t] = widen16(s16[t]);
          if constexpr (kFifth) ia[t] = _mm256_add_epi32(ia[t], widen16(h16[t]));
        }
      } else {
        [[maybe_unused]] __m256i qh;
        if constexpr (kFifth) qh = load32(blk.qh);
        auto group = [&]<int G>() {
          const __m256i v = load32(blk.qs[G]);
          __m256i lo = _mm256_and_si256(v, m4), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
          if constexpr (kFifth) {  // bit 2G (2G + 1) to bit 4
            lo = _mm256_or_si256(lo, shift_bits<2 * G - 4>(qh, 0x10));
            hi = _mm256_or_si256(hi, shift_bits<2 * G + 1 - 4>(qh, 0x10));
          }
          for (int t = 0; t < NX; ++t) {
            const int8_t* q = x[t][b].q + 4 * G;
            ia[t] = dot_acc(ia[t], lo, bcast4(q));
            ia[t] = dot_acc(ia[t], hi, bcast4(q + 16));
            pin(ia[t]);
          }
        };
        group.template operator()<0>();
        group.template operator()<1>();
        group.template operator()<2>();
        group.template operator()<3>();
      }
      const __m256 d = halves(blk.d);
      [[maybe_unused]] __m256 m;
      if constexpr (kZero == Zero::kMin) m = halves(blk.m);
      for (int t = 0; t < NX; ++t) {
        const ActQ8& a = x[t][b];
        acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ia[t]), _mm256_mul_ps(d, _mm256_set1_ps(a.d)), acc[t]);
        if constexpr (kZero == Zero::k8) acc[t] = _mm256_fnmadd_ps(d, _mm256_set1_ps(8.0f * a.dsum), acc[t]);
        if constexpr (kZero == Zero::k16) acc[t] = _mm256_fnmadd_ps(d, _mm256_set1_ps(16.0f * a.dsum), acc[t]);
        if constexpr (kZero == Zero::kMin) acc[t] = _mm256_fmadd_ps(m, _mm256_set1_ps(a.msum), acc[t]);
      }
    }
  }
};
template <int NX> using Q4_0X8 = Dot32<NX, X8Q4_0, Zero::k8, false>;
template <int NX> using Q4_1X8 = Dot32<NX, X8Q4_1, Zero::kMin, false>;
template <int NX> using Q5_0X8 = Dot32<NX, X8Q5_0, Zero::k16, true>;
template <int NX> using Q5_1X8 = Dot32<NX, X8Q5_1, Zero::kMin, true>;
template <int NX> using Q8_0X8 = Dot32<NX, X8Q8_0, Zero::kNone, false>;

template <int NX>
struct Q4_KX8 {
  static void run(const uint8_t* wg, const ActQ8K* const* x, int64_t nb, __m256* acc) {
    const X8Q4_K* w = reinterpret_cast<const X8Q4_K*>(wg);
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    for (int64_t b = 0; b < nb; ++b) {
      const X8Q4_K& blk = w[b];
      prefetch_ahead(blk);
      __m256i isum[NX];
      for (int t = 0; t < NX; ++t) isum[t] = _mm256_setzero_si256();
      // Per sub-block: without VNNI the 8 groups' maddubs sums of 4-bit values stay in int16
      // (8 x 3,810) and one madd by the 8 rows' scales widens and scales them; with VNNI,
      // dpbusd sums in int32 and mullo scales.
      for (int c = 0; c < 4; ++c) {
        __m256i alo[NX], ahi[NX];  // sub-blocks 2c and 2c + 1, unscaled
        for (int t = 0; t < NX; ++t) alo[t] = ahi[t] = _mm256_setzero_si256();
        for (int g = 0; g < 8; ++g) {
          const __m256i v = load32(blk.qs[c][g]);
          const __m256i lo = _mm256_and_si256(v, m4), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
          for (int t = 0; t < NX; ++t) {
            const int8_t* q = x[t][b].q + 64 * c + 4 * g;
            alo[t] = sub_acc(alo[t], lo, bcast4(q));
            ahi[t] = sub_acc(ahi[t], hi, bcast4(q + 32));
            pin(alo[t]), pin(ahi[t]);
          }
        }
        const __m256i sl = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(blk.sc[2 * c])));
        const __m256i sh = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(blk.sc[2 * c + 1])));
        for (int t = 0; t < NX; ++t)
          isum[t] = _mm256_add_epi32(isum[t], _mm256_add_epi32(sub_scaled(alo[t], sl), sub_scaled(ahi[t], sh)));
      }
      __m256i mn[4];  // int16 pairs (min 2i, min 2i + 1) per lane
      for (int i = 0; i < 4; ++i) mn[i] = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk.mn[i])));
      const __m256 d = halves(blk.d), dmin = halves(blk.dmin);
      for (int t = 0; t < NX; ++t) {
        const ActQ8K& a = x[t][b];
        __m256i msum = _mm256_madd_epi16(mn[0], bcast4(a.sums32));
        for (int i = 1; i < 4; ++i) msum = _mm256_add_epi32(msum, _mm256_madd_epi16(mn[i], bcast4(a.sums32 + 2 * i)));
        const __m256 ad = _mm256_set1_ps(a.d);
        acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[t]), _mm256_mul_ps(d, ad), acc[t]);
        acc[t] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(msum), _mm256_mul_ps(dmin, ad), acc[t]);
      }
    }
  }
};

template <int NX>
struct Q6_KX8 {
  static void run(const uint8_t* wg, const ActQ8K* const* x, int64_t nb, __m256* acc) {
    const X8Q6_K* w = reinterpret_cast<const X8Q6_K*>(wg);
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    for (int64_t b = 0; b < nb; ++b) {
      const X8Q6_K& blk = w[b];
      prefetch_ahead(blk);
      __m256i isum[NX];
      for (int t = 0; t < NX; ++t) isum[t] = _mm256_setzero_si256();
      auto chunk = [&]<int C>() __attribute__((always_inline)) {
        const X8Q6_KChunk& ch = blk.ch[C];
        // scale groups 4C .. 4C + 3: low half values 0-15 (a0), 16-31 (a1); high half (a2, a3)
        __m256i a0[NX], a1[NX], a2[NX], a3[NX];
        auto step = [&]<int G>(__m256i* alo, __m256i* ahi) __attribute__((always_inline)) {
          constexpr int f = 4 * (G % 2);  // the low half's top bits at f, the high half's at f + 2
          const __m256i v = load32(ch.ql[G]), h = load32(ch.qh[G / 2]);
          const __m256i lo = _mm256_or_si256(_mm256_and_si256(v, m4), shift_bits<f - 4>(h, 0x30));
          const __m256i hi = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v, 4), m4), shift_bits<f - 2>(h, 0x30));
          for (int t = 0; t < NX; ++t) {
            const int8_t* q = x[t][b].q + 64 * C + 4 * G;
            alo[t] = dot_acc(alo[t], lo, bcast4(q));
            ahi[t] = dot_acc(ahi[t], hi, bcast4(q + 32));
            pin(alo[t]), pin(ahi[t]);
          }
        };
        for (int t = 0; t < NX; ++t) a0[t] = a1[t] = a2[t] = a3[t] = _mm256_setzero_si256();
        step.template operator()<0>(a0, a2);
        step.template operator()<1>(a0, a2);
        step.template operator()<2>(a0, a2);
        step.template operator()<3>(a0, a2);
        step.template operator()<4>(a1, a3);
        step.template operator()<5>(a1, a3);
        step.template operator()<6>(a1, a3);
        step.template operator()<7>(a1, a3);
        for (int p = 0; p < 2; ++p) {  // scale pairs 2C + p: groups 4C + 2p, 4C + 2p + 1
          const __m256i pair = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk.sc[2 * C + p])));
          const __m256i s0 = _mm256_srai_epi32(_mm256_slli_epi32(pair, 16), 16), s1 = _mm256_srai_epi32(pair, 16);
          const __m256i* e0 = p == 0 ? a0 : a2;
          const __m256i* e1 = p == 0 ? a1 : a3;
          for (int t = 0; t < NX; ++t)
            isum[t] = _mm256_add_epi32(isum[t], _mm256_add_epi32(_mm256_mullo_epi32(e0[t], s0), _mm256_mullo_epi32(e1[t], s1)));
        }
      };
      // Without VNNI: two steps' maddubs sums of 6-bit values stay in int16 (2 x 16,002), then
      // one madd by the scale group's int16 scales (duplicated in each lane) widens them.
      auto chunk16 = [&]<int C>() __attribute__((always_inline)) {
        const X8Q6_KChunk& ch = blk.ch[C];
        const __m256i p0 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk.sc[2 * C])));
        const __m256i p1 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk.sc[2 * C + 1])));
        auto first = [](__m256i p) { return _mm256_blend_epi16(p, _mm256_slli_epi32(p, 16), 0xAA); };
        auto second = [](__m256i p) { return _mm256_blend_epi16(_mm256_srli_epi32(p, 16), p, 0xAA); };
        auto values = [&]<int G>(__m256i& lo, __m256i& hi) __attribute__((always_inline)) {
          constexpr int f = 4 * (G % 2);
          const __m256i v = load32(ch.ql[G]), h = load32(ch.qh[G / 2]);
          lo = _mm256_or_si256(_mm256_and_si256(v, m4), shift_bits<f - 4>(h, 0x30));
          hi = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v, 4), m4), shift_bits<f - 2>(h, 0x30));
        };
        auto two = [&]<int G>(__m256i slo, __m256i shi) __attribute__((always_inline)) {  // steps G, G + 1
          __m256i lo0, hi0, lo1, hi1;
          values.template operator()<G>(lo0, hi0);
          values.template operator()<G + 1>(lo1, hi1);
          for (int t = 0; t < NX; ++t) {
            const int8_t* q = x[t][b].q + 64 * C + 4 * G;
            const __m256i l16 = _mm256_add_epi16(pairs16(lo0, bcast4(q)), pairs16(lo1, bcast4(q + 4)));
            const __m256i h16 = _mm256_add_epi16(pairs16(hi0, bcast4(q + 32)), pairs16(hi1, bcast4(q + 36)));
            isum[t] = _mm256_add_epi32(isum[t], _mm256_add_epi32(_mm256_madd_epi16(l16, slo), _mm256_madd_epi16(h16, shi)));
            pin(isum[t]);
          }
        };
        two.template operator()<0>(first(p0), first(p1));
        two.template operator()<2>(first(p0), first(p1));
        two.template operator()<4>(second(p0), second(p1));
        two.template operator()<6>(second(p0), second(p1));
      };
      if constexpr (kSum16) {
        chunk16.template operator()<0>();
        chunk16.template operator()<1>();
        chunk16.template operator()<2>();
        chunk16.template operator()<3>();
      } else {
        chunk.template operator()<0>();
        chunk.template operator()<1>();
        chunk.template operator()<2>();
        chunk.template operator()<3>();
      }
      // the -32 zero point: 32 * sum over groups s of scale_s * (sum of x in s)
      __m256i zp[NX];
      for (int t = 0; t < NX; ++t) zp[t] = _mm256_setzero_si256();
      for (int i = 0; i < 8; ++i) {
        const __m256i pair = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk.sc[i])));
        for (int t = 0; t < NX; ++t) zp[t] = _mm256_add_epi32(zp[t], _mm256_madd_epi16(pair, bcast4(x[t][b].bsums + 2 * i)));
      }
      const __m256 d = halves(blk.d);
      for (int t = 0; t < NX; ++t) {
        const __m256i total = _mm256_sub_epi32(isum[t], _mm256_slli_epi32(zp[t], 5));
        acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(total), _mm256_mul_ps(d, _mm256_set1_ps(x[t][b].d)), acc[t]);
      }
    }
  }
};

#include "quant_x8_avx512.h"  // Q4_KX8Z where the CPU has AVX-512 VNNI
// Activation rows per pass over a group's weights (each row keeps 3-5 accumulators): 5 with
// AVX-512's 32 vector registers (6 spill), 4 with AVX2's 16; Q4_KX8Z, 8. Q6_K without VNNI keeps
// one accumulator a row, so 6 rows share each decoded weight vector there (one thread, 8960 x
// 1536: 5 rows 1.15 ms against 1.42 as 4 + 1; level with 4 a pass per row at 8 to 64 rows).
#if defined(__AVX512VL__)
constexpr int kNX = 5;
#else
constexpr int kNX = 4;
#endif
template <template <int> class Dot>
constexpr int kRows = kNX;
template <>
constexpr int kRows<Q6_KX8> = kSum16 ? 6 : kNX;
#ifdef IMPASTO_X8_ZMM
template <>
constexpr int kRows<Q4_KX8Z> = kQ4_KRowsZ;
#endif
constexpr int64_t kTile = 64;  // activation rows kept hot while a thread's groups stream

// Dot<n>::run for a run-time n in [1, N].
template <template <int> class Dot, int N, typename Act>
inline void run_rows(int64_t n, const uint8_t* wg, const Act* const* xs, int64_t nb, __m256* acc) {
  if constexpr (N > 1) {
    if (n < N) return run_rows<Dot, N - 1>(n, wg, xs, nb, acc);
  }
  Dot<N>::run(wg, xs, nb, acc);
}

template <template <int> class Dot, typename Act>
void run_groups(const uint8_t* w, int64_t group_bytes, int64_t g_lo, int64_t g_hi, const Act* acts, int64_t nb,
                int64_t rows, const Out& y, int64_t col0) {
  constexpr int NX = kRows<Dot>;
  const Act* xs[NX];
  __m256 acc[NX];
  alignas(32) float res[8];
  for (int64_t t0 = 0; t0 < rows; t0 += kTile) {
    const int64_t tn = std::min(kTile, rows - t0);
    for (int64_t g = g_lo; g < g_hi; ++g) {
      const uint8_t* wg = w + g * group_bytes;
      // passes of near-equal sizes (8 rows at NX = 6: 4 + 4, not 6 + 2)
      const int64_t passes = (tn + NX - 1) / NX;
      for (int64_t p = 0, t = t0, n; p < passes; ++p, t += n) {
        n = (t0 + tn - t) / (passes - p);
        for (int64_t i = 0; i < n; ++i) xs[i] = acts + (t + i) * nb, acc[i] = _mm256_setzero_ps();
        run_rows<Dot, NX>(n, wg, xs, nb, acc);
        for (int64_t i = 0; i < n; ++i) {
          _mm256_store_ps(res, acc[i]);
          for (int r = 0; r < 8; ++r) y.store(t + i, col0 + 8 * g + r, res[r]);
        }
      }
    }
  }
}
#endif  // IMPASTO_AVX2

}  // namespace

bool x8_supported(int64_t qtype) {
#ifdef IMPASTO_AVX2
  switch (qtype) {
    case kQ4_0: case kQ4_1: case kQ5_0: case kQ5_1: case kQ8_0: case kQ4_K: case kQ6_K: return true;
    default: return false;
  }
#else
  (void)qtype;
  return false;
#endif
}

void x8_run(int64_t qtype, const uint8_t* w, int64_t group_bytes, int64_t g_lo, int64_t g_hi, const void* acts,
            int64_t nb, int64_t rows, const Out& y, int64_t col0) {
#ifdef IMPASTO_AVX2
  const auto* a32 = static_cast<const ActQ8*>(acts);
  const auto* a256 = static_cast<const ActQ8K*>(acts);
  switch (qtype) {
    case kQ4_0: run_groups<Q4_0X8>(w, group_bytes, g_lo, g_hi, a32, nb, rows, y, col0); break;
    case kQ4_1: run_groups<Q4_1X8>(w, group_bytes, g_lo, g_hi, a32, nb, rows, y, col0); break;
    case kQ5_0: run_groups<Q5_0X8>(w, group_bytes, g_lo, g_hi, a32, nb, rows, y, col0); break;
    case kQ5_1: run_groups<Q5_1X8>(w, group_bytes, g_lo, g_hi, a32, nb, rows, y, col0); break;
    case kQ8_0: run_groups<Q8_0X8>(w, group_bytes, g_lo, g_hi, a32, nb, rows, y, col0); break;
#ifdef IMPASTO_X8_ZMM
    case kQ4_K: run_groups<Q4_KX8Z>(w, group_bytes, g_lo, g_hi, a256, nb, rows, y, col0); break;
#else
    case kQ4_K: run_groups<Q4_KX8>(w, group_bytes, g_lo, g_hi, a256, nb, rows, y, col0); break;
#endif
    case kQ6_K: run_groups<Q6_KX8>(w, group_bytes, g_lo, g_hi, a256, nb, rows, y, col0); break;
    default: TORCH_CHECK(false, "quant_linear: no interleaved kernel for GGML type ", qtype);
  }
#else
  (void)qtype, (void)w, (void)group_bytes, (void)g_lo, (void)g_hi, (void)acts, (void)nb, (void)rows, (void)y, (void)col0;
  TORCH_CHECK(false, "quant_linear: this build has no interleaved kernels");
#endif
}

}  // namespace impasto_quant
