// The AVX-512 form of the interleaved Q4_K kernel (quant_x8.cpp includes this inside its
// namespace, after its helpers; the layout is quant_x8_layout.h's, unchanged).
//
// Why: beyond one activation row the 256-bit kernels are bound by their dot-product
// instructions, not by memory (a speculative verification, batched decode, prefill). On a CPU
// whose 512-bit dpbusd issues as fast as the 256-bit one (measured: 1.8 G/s each per core on an
// AMD EPYC with AVX-512 VNNI), one zmm instruction does two ymm instructions' work. A zmm holds
// 8 weight rows twice: lane 2r = the low nibbles of row r's 4-byte group g, lane 2r + 1 = the
// high ones. The two halves of a Q4_K chunk meet different activations
// (values 64c + 4g.. and 64c + 32 + 4g..), so the activations come rearranged into qwords
// (those two dwords side by side: ActQ8K::pairs) and one 64-bit broadcast feeds a dpbusd.
//
// Arithmetic: the same exact int32 sums per (row, sub-block), scaled by the same integers, then
// the same float terms in the same order as the 256-bit kernels: the outputs are the same bits
// (tests/kernels/test_quant_ops.py compares this build with an AVX2-only one).
//
// Measured (2 threads, same run, against the 256-bit kernel): Q4_K 8960 x 1536 0.62x at 8-16
// activation rows, 0.75-0.9x at 1-4; Qwen2.5-Coder-1.5B Q4_K_M batch-16 decode +7 %, 512-token
// prefill -4 %. A Q6_K form built the same way measured level with the 256-bit kernel (its
// decode is twice Q4_K's work per byte), so Q6_K keeps that one.
#pragma once

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__)
#define IMPASTO_X8_ZMM 1

// Activation rows per pass (kRows in quant_x8.cpp): 3 registers a row of the 32. 8960 x 1536,
// 2 threads, against the 256-bit kernel at its 5 rows a pass: 0.62x at 8 and 16 rows (0.80x
// at 6 rows a pass), 0.75-0.9x at 1-4 rows.
constexpr int kQ4_KRowsZ = 8;

inline void pin(__m512i& v) { asm("" : "+v"(v)); }

// qword g of chunk c of an activation block's pairs, in every lane
inline __m512i pair_at(const ActQ8K& a, int c, int g) {
  return _mm512_broadcastq_epi64(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(a.pairs + 64 * c + 8 * g)));
}

// int32 lane pairs (2r, 2r + 1) -> their sum in lane r (mod 2^32, as the 256-bit adds).
inline __m256i pair_sums(__m512i v) { return _mm512_cvtepi64_epi32(_mm512_add_epi32(v, _mm512_srli_epi64(v, 32))); }

template <int NX>
struct Q4_KX8Z {
  static void run(const uint8_t* wg, const ActQ8K* const* x, int64_t nb, __m256* acc) {
    const X8Q4_K* w = reinterpret_cast<const X8Q4_K*>(wg);
    const __m512i m4 = _mm512_set1_epi8(0x0F);
    for (int64_t b = 0; b < nb; ++b) {
      const X8Q4_K& blk = w[b];
      prefetch_ahead(blk);
      __m512i isum[NX];  // lane 2r: row r's even sub-blocks, scaled; 2r + 1: the odd ones
      for (int t = 0; t < NX; ++t) isum[t] = _mm512_setzero_si512();
      for (int c = 0; c < 4; ++c) {
        __m512i s[NX];
        for (int t = 0; t < NX; ++t) s[t] = _mm512_setzero_si512();
        for (int g = 0; g < 8; ++g) {
          // row r's dword in lane 2r, and shifted by 28 bits its high nibbles in lane 2r + 1
          const __m512i v = _mm512_cvtepu32_epi64(load32(blk.qs[c][g]));
          const __m512i u = _mm512_ternarylogic_epi32(v, _mm512_slli_epi64(v, 28), m4, 0xA8);  // (v | v << 28) & m4
          for (int t = 0; t < NX; ++t) s[t] = _mm512_dpbusd_epi32(s[t], u, pair_at(x[t][b], c, g)), pin(s[t]);
        }
        // sub-block 2c's scales (bytes 0-7) and 2c + 1's (8-15), interleaved to the lane pairs
        const __m128i sc = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk.sc[2 * c]));
        const __m512i scale = _mm512_cvtepu8_epi32(_mm_unpacklo_epi8(sc, _mm_srli_si128(sc, 8)));
        for (int t = 0; t < NX; ++t) isum[t] = _mm512_add_epi32(isum[t], _mm512_mullo_epi32(s[t], scale));
      }
      __m256i mn[4];  // int16 pairs (min 2i, min 2i + 1) per lane
      for (int i = 0; i < 4; ++i) mn[i] = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk.mn[i])));
      const __m256 d = halves(blk.d), dmin = halves(blk.dmin);
      for (int t = 0; t < NX; ++t) {
        const ActQ8K& a = x[t][b];
        __m256i msum = _mm256_madd_epi16(mn[0], bcast4(a.sums32));
        for (int i = 1; i < 4; ++i) msum = _mm256_add_epi32(msum, _mm256_madd_epi16(mn[i], bcast4(a.sums32 + 2 * i)));
        const __m256 ad = _mm256_set1_ps(a.d);
        acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(pair_sums(isum[t])), _mm256_mul_ps(d, ad), acc[t]);
        acc[t] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(msum), _mm256_mul_ps(dmin, ad), acc[t]);
      }
    }
  }
};

#endif
