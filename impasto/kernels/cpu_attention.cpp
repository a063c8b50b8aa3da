// Paged attention for the 16-bit decode path (see impasto/kernels/__init__.py): the op
// `paged_attention`, which the attention backend calls for steps where every request is a
// short query that writes its keys (decodes, speculative verification), and which the decoder
// stack (cpu_ops.cpp) calls once per layer. One call writes the step's K/V rows into the paged
// cache, then attends each request's queries over that request's cached keys, replacing about
// twelve eager ops.
//
// Invariants: q, k, v are [T, H, D] heads and the cache is [2, NB, bs, Hkv, D] (cpu_ops.h);
// float32 arithmetic with one rounding on store; the softmax is exact (two passes over a row's
// scores, not an online rescaling); and a query row's bits depend on nothing but its own keys,
// so batching, tiling, threading and prefix caching leave results unchanged (the comment at
// kQueryTile says why).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "cpu_ops.h"
#include "vec_math.h"

namespace impasto_cpu {
namespace {

using impasto_vec::dot;
using impasto_vec::dot4;
using impasto_vec::fast_exp;
using impasto_vec::from_f;
using impasto_vec::load_row;
using impasto_vec::to_f;

// ---------------------------------------------------------------- paged attention
// Writes the step's k/v at slot_mapping, then attends every request's queries over its cached
// keys 0..seq_len-1 (which now include this step's). One work item = (request, KV head): the
// G query heads sharing a KV head, for a tile of the request's query tokens, read each cached
// key/value row once. Scores are kept for the whole context (two passes: exact softmax).
//
// Each query row's result depends only on its own scores, taken in key order: keys outside its
// range get probability exactly 0 (adding 0 and skipping p == 0 change no sum), so the bits of
// a row are the same whatever other rows share its tile, its step or its batch, and whether its
// keys were cached by an earlier step (prefix caching, chunked prefill) or written by this one.
constexpr int64_t kQueryTile = 64;  // query tokens per work item's pass
// K (V) rows widened to float32 per pass: each tile meets every query row while it is in L1,
// and a row's scores (its output) are written (accumulated) contiguously, in key order.
constexpr int64_t kKeyTile = 32;

struct AttnArgs {
  int64_t hq, hkv, d, bs, window;
  double scale, softcap;
};

template <typename T>
void attend(const T* q, int64_t qts, int64_t qhs, const T* kc, const T* vc, const int64_t* bt,
            int64_t bts, const int64_t* qsl, const int64_t* seq, const bool* causal, T* out,
            int64_t num_reqs, const AttnArgs& a) {
  const int64_t d = a.d, row = a.hkv * d;  // row: one slot's K (or V)
  // Few (request, KV head) items (a batch-1 decode: 3 on SmolLM2 for 2 threads, one thread
  // doing two) leave threads idle, so then each item takes a part of the G query heads: every
  // query row is computed on its own (above), so how rows are grouped changes no bit.
  const int64_t parts = num_reqs * a.hkv >= 4 * at::get_num_threads() ? 1 : a.hq / a.hkv;
  const int64_t g = a.hq / a.hkv / parts;  // query heads per item
  const float ninf = -std::numeric_limits<float>::infinity();
  // K/V rows of one head are `row` elements apart and scattered over blocks: fetching a few
  // rows ahead lets the loads of a decode step (the cache is cold after the weights stream
  // through) overlap instead of waiting on memory one row at a time.
  constexpr int64_t kAhead = 32;
  auto slot_of = [&](int64_t b, int64_t k) { return bt[b * bts + k / a.bs] * a.bs + k % a.bs; };
  auto prefetch_row = [&](const T* base, int64_t b, int64_t k, int64_t h) {
    const int64_t slot = slot_of(b, k);
    const char* p = reinterpret_cast<const char*>(base + slot * row + h * d);
    for (int64_t off = 0; off < d * static_cast<int64_t>(sizeof(T)); off += 64) __builtin_prefetch(p + off, 0, 3);  // prefetcht0 on x86; portable
  };
  at::parallel_for(0, num_reqs * a.hkv * parts, 1, [&](int64_t lo, int64_t hi) {
    std::vector<float> qf, sc, acc, denom, kv(kKeyTile * d);
    for (int64_t item = lo; item < hi; ++item) {
      const int64_t b = item / (a.hkv * parts), h = item / parts % a.hkv, part = item % parts;
      const int64_t req_start = qsl[b], req_qlen = qsl[b + 1] - req_start, len = seq[b];
      // Query tiles bound the scores buffer (tile * G * len floats) for long prompts.
      for (int64_t tile = 0; tile < req_qlen; tile += kQueryTile) {
      const int64_t start = req_start + tile, qlen = std::min(kQueryTile, req_qlen - tile);
      const int64_t ctx = len - req_qlen + tile;  // position of the tile's first query
      const int64_t nrows = qlen * g;  // row r = i * G + j: query token i, head h*G + j
      qf.resize(nrows * d);
      sc.resize(nrows * len);
      acc.assign(nrows * d, 0.0f);
      const float scale = (float)a.scale;
      for (int64_t i = 0; i < qlen; ++i)
        for (int64_t j = 0; j < g; ++j) {
          const T* src = q + (start + i) * qts + (h * g * parts + part * g + j) * qhs;
          float* dst = qf.data() + (i * g + j) * d;
          for (int64_t e = 0; e < d; ++e) dst[e] = to_f(src[e]) * scale;
        }
      // Visible keys of query token i (position ctx + i): [lo_i, hi_i).
      auto range = [&](int64_t i, int64_t& klo, int64_t& khi) {
        const int64_t p = ctx + i;
        khi = causal[b] ? p + 1 : len;
        klo = 0;
        if (a.window > 0) {
          klo = std::max<int64_t>(0, p - a.window + 1);
          if (!causal[b]) khi = std::min<int64_t>(len, p + a.window);
        }
      };
      int64_t all_lo = len, all_hi = 0;
      for (int64_t i = 0; i < qlen; ++i) {
        int64_t klo, khi;
        range(i, klo, khi);
        all_lo = std::min(all_lo, klo);
        all_hi = std::max(all_hi, khi);
      }
      for (int64_t k = all_lo; k < std::min(all_lo + kAhead, all_hi); ++k) prefetch_row(kc, b, k, h);
      for (int64_t k0 = all_lo; k0 < all_hi; k0 += kKeyTile) {  // scores: a K tile feeds every query row
        const int64_t kn = std::min(kKeyTile, all_hi - k0);
        for (int64_t k = k0; k < k0 + kn; ++k) {
          if (k + kAhead < all_hi) prefetch_row(kc, b, k + kAhead, h);
          else if (all_lo + k + kAhead - all_hi < all_hi) prefetch_row(vc, b, all_lo + k + kAhead - all_hi, h);  // first V rows
          load_row(kc + slot_of(b, k) * row + h * d, kv.data() + (k - k0) * d, d);
        }
        for (int64_t r = 0; r < nrows; ++r) {
          const float* qr = qf.data() + r * d;
          float* s = sc.data() + r * len + k0;
          int64_t j = 0;
          for (; j + 4 <= kn; j += 4) {
            const float* ks[4] = {&kv[j * d], &kv[(j + 1) * d], &kv[(j + 2) * d], &kv[(j + 3) * d]};
            dot4(qr, ks, d, s + j);
          }
          for (; j < kn; ++j) s[j] = dot(qr, kv.data() + j * d, d);
          if (a.softcap > 0)
            for (j = 0; j < kn; ++j) s[j] = std::tanh(s[j] / (float)a.softcap) * (float)a.softcap;
        }
      }
      denom.resize(nrows);
      for (int64_t i = 0; i < qlen; ++i) {  // masked, exact softmax per query row
        int64_t klo, khi;
        range(i, klo, khi);
        for (int64_t j = 0; j < g; ++j) {
          float* s = sc.data() + (i * g + j) * len;
          for (int64_t k = all_lo; k < klo; ++k) s[k] = ninf;
          for (int64_t k = khi; k < all_hi; ++k) s[k] = ninf;
          float m = ninf;
          for (int64_t k = klo; k < khi; ++k) m = s[k] > m ? s[k] : m;
          float sum = 0.0f;
          for (int64_t k = all_lo; k < all_hi; ++k) {
            const float e = k >= klo && k < khi ? fast_exp(s[k] - m) : 0.0f;
            s[k] = e;
            sum += e;
          }
          denom[i * g + j] = sum;
        }
      }
      for (int64_t k0 = all_lo; k0 < all_hi; k0 += kKeyTile) {  // P @ V: a V tile feeds every query row
        const int64_t kn = std::min(kKeyTile, all_hi - k0);
        for (int64_t k = k0; k < k0 + kn; ++k) {
          if (k + kAhead < all_hi) prefetch_row(vc, b, k + kAhead, h);
          load_row(vc + slot_of(b, k) * row + h * d, kv.data() + (k - k0) * d, d);
        }
        for (int64_t r = 0; r < nrows; ++r) {
          const float* p = sc.data() + r * len + k0;
          float* o = acc.data() + r * d;
          for (int64_t j = 0; j < kn; ++j) {
            if (p[j] == 0.0f) continue;
            const float* vr = kv.data() + j * d;
            for (int64_t e = 0; e < d; ++e) o[e] += p[j] * vr[e];
          }
        }
      }
      for (int64_t i = 0; i < qlen; ++i)
        for (int64_t j = 0; j < g; ++j) {
          const int64_t r = i * g + j;
          const float inv = 1.0f / denom[r];
          T* dst = out + (start + i) * a.hq * d + (h * g * parts + part * g + j) * d;
          for (int64_t e = 0; e < d; ++e) dst[e] = from_f<T>(acc[r * d + e] * inv);
        }
      }  // query tiles
    }
  });
}

template <typename T>
void write_kv(const at::Tensor& k, const at::Tensor& v, T* cache, int64_t half, const int64_t* slots,
              int64_t tokens, int64_t hkv, int64_t d) {
  const T* kp = cdata<T>(k);
  const T* vp = cdata<T>(v);
  for (int64_t t = 0; t < tokens; ++t) {
    const int64_t s = slots[t];
    if (s < 0) continue;
    for (int64_t h = 0; h < hkv; ++h) {
      std::memcpy(cache + (s * hkv + h) * d, kp + t * k.stride(0) + h * k.stride(1), d * sizeof(T));
      std::memcpy(cache + half + (s * hkv + h) * d, vp + t * v.stride(0) + h * v.stride(1), d * sizeof(T));
    }
  }
}

}  // namespace

at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                           at::Tensor kv_cache, const at::Tensor& slot_mapping,
                           const at::Tensor& block_table, const at::Tensor& query_start_loc,
                           const at::Tensor& seq_lens, const at::Tensor& causal, double scale,
                           int64_t window, double softcap) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3 && q.stride(2) == 1 &&
                  k.stride(2) == 1 && v.stride(2) == 1,
              "paged_attention: q/k/v must be [T, H, D] with D contiguous");
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.is_contiguous() && kv_cache.size(0) == 2,
              "paged_attention: kv_cache must be a contiguous [2, NB, bs, Hkv, D] tensor");
  const int64_t tokens = q.size(0), hq = q.size(1), d = q.size(2), hkv = kv_cache.size(3);
  TORCH_CHECK(kv_cache.size(4) == d && k.size(1) == hkv && v.size(1) == hkv && k.size(2) == d &&
                  v.size(2) == d && hq % hkv == 0,
              "paged_attention: head shapes disagree");
  const auto dt = q.scalar_type();
  TORCH_CHECK(k.scalar_type() == dt && v.scalar_type() == dt && kv_cache.scalar_type() == dt,
              "paged_attention: q, k, v and the cache must share a dtype");
  for (const auto* t : {&slot_mapping, &block_table, &query_start_loc, &seq_lens})
    TORCH_CHECK(t->scalar_type() == at::kLong && t->stride(-1) == 1, "paged_attention: int64 indices");
  TORCH_CHECK(causal.scalar_type() == at::kBool && causal.is_contiguous(), "causal must be bool");
  const int64_t num_reqs = seq_lens.size(0);
  TORCH_CHECK(query_start_loc.size(0) == num_reqs + 1 && causal.size(0) == num_reqs &&
                  block_table.size(0) >= num_reqs && slot_mapping.size(0) == tokens,
              "paged_attention: metadata sizes disagree");
  const AttnArgs a{hq, hkv, d, kv_cache.size(2), window, scale, softcap};
  const int64_t half = kv_cache.numel() / 2;
  auto out = at::empty({tokens, hq * d}, q.options());
  auto run = [&](auto tag) {
    using T = decltype(tag);
    T* cache = mdata<T>(kv_cache);
    write_kv<T>(k, v, cache, half, cdata<int64_t>(slot_mapping), tokens, hkv, d);
    attend<T>(cdata<T>(q), q.stride(0), q.stride(1), cache, cache + half,
              cdata<int64_t>(block_table), block_table.stride(0),
              cdata<int64_t>(query_start_loc), cdata<int64_t>(seq_lens),
              cdata<bool>(causal), mdata<T>(out), num_reqs, a);
  };
  if (dt == at::kBFloat16) run(bf16{});
  else if (dt == at::kFloat) run(float{});
  else TORCH_CHECK(false, "paged_attention: float32 or bfloat16 only");
  return out;
}

}  // namespace impasto_cpu

TORCH_LIBRARY_FRAGMENT(impasto, m) {
  m.def(
      "paged_attention(Tensor q, Tensor k, Tensor v, Tensor(a!) kv_cache, Tensor slot_mapping, "
      "Tensor block_table, Tensor query_start_loc, Tensor seq_lens, Tensor causal, float scale, "
      "int window, float softcap) -> Tensor");
}

TORCH_LIBRARY_IMPL(impasto, CPU, m) { m.impl("paged_attention", &impasto_cpu::paged_attention); }
