// Fused CPU kernels for the 16-bit decode path (see impasto/kernels/__init__.py).
//
// Why: a batch-1 decode step of a 135M model is ~9 ms of weight streaming and, in eager
// PyTorch, ~400 more small kernels (norms, rotary, cache writes, attention pieces), each paying
// dispatch and allocation costs that exceed its arithmetic. These kernels do each group of them
// in one call. All arithmetic is float32; 16-bit values are rounded once on store (round to
// nearest even), so results are at least as accurate as the eager bf16 path, not bit-identical.
//
// Layout conventions (checked on entry):
//   rows   [T, N]               last dim contiguous, any row stride
//   heads  [T, H, D]            D contiguous (views into a fused qkv projection are fine)
//   cache  [2, NB, bs, Hkv, D]  contiguous; slot s = block * bs + offset
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <array>
#include <optional>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <tuple>
#include <type_traits>
#include <vector>

#include "quant_ops.h"
#include "vec_math.h"

namespace {

using impasto_vec::fast_exp;

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

template <typename T> const T* cdata(const at::Tensor& t) {
  if constexpr (std::is_same_v<T, bf16>) return reinterpret_cast<const bf16*>(t.const_data_ptr<c10::BFloat16>());
  else return t.const_data_ptr<T>();
}
template <typename T> T* mdata(const at::Tensor& t) {
  if constexpr (std::is_same_v<T, bf16>) return reinterpret_cast<bf16*>(t.mutable_data_ptr<c10::BFloat16>());
  else return t.mutable_data_ptr<T>();
}

inline float dot(const float* a, const float* b, int64_t n) {
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};  // 8 lanes: one AVX register, no reassociation
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (int l = 0; l < 8; ++l) acc[l] += a[i + l] * b[i + l];
  float s = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

template <typename T> inline void load_row(const T* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = to_f(src[i]);
}

void check_rows(const at::Tensor& x, const char* name) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, name, " must be [T, N] with a contiguous last dim");
}

// [..., N] -> [rows, N] with a contiguous last dim: a view where the strides allow (2-D rows
// of a wider buffer stay views), else a copy. Row kernels take any leading shape through it.
at::Tensor as_rows(const at::Tensor& x) {
  TORCH_CHECK(x.dim() >= 1, "expected a tensor with at least one dimension");
  if (x.dim() == 2 && x.stride(1) == 1) return x;
  return (x.stride(-1) == 1 ? x : x.contiguous()).reshape({-1, x.size(-1)});
}

int64_t grain_rows(int64_t width) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(width, 1)); }

// ---------------------------------------------------------------- RMSNorm (+ residual add)
template <typename T>
void rms_norm_rows(const T* x, int64_t xs, const T* res, int64_t rs, T* sum, const T* w,
                   T* out, int64_t rows, int64_t n, double eps, bool gemma) {
  at::parallel_for(0, rows, grain_rows(n), [&](int64_t lo, int64_t hi) {
    std::vector<float> buf(n);
    for (int64_t t = lo; t < hi; ++t) {
      const T* xr = x + t * xs;
      if (res != nullptr) {  // the residual stream is stored in T: round the sum first
        const T* rr = res + t * rs;
        T* sr = sum + t * n;
        for (int64_t i = 0; i < n; ++i) {
          sr[i] = from_f<T>(to_f(xr[i]) + to_f(rr[i]));
          buf[i] = to_f(sr[i]);
        }
      } else {
        load_row(xr, buf.data(), n);
      }
      const float inv = 1.0f / std::sqrt(dot(buf.data(), buf.data(), n) / n + (float)eps);
      T* o = out + t * n;
      for (int64_t i = 0; i < n; ++i) {
        const float wi = gemma ? 1.0f + to_f(w[i]) : to_f(w[i]);
        o[i] = from_f<T>(buf[i] * inv * wi);
      }
    }
  });
}

// x [..., N] (and residual of x's shape): the outputs have x's shape, contiguous.
std::tuple<at::Tensor, at::Tensor> norm_impl(const at::Tensor& x_in, const std::optional<at::Tensor>& residual,
                                             const at::Tensor& weight, double eps, bool gemma) {
  const at::Tensor x = as_rows(x_in);
  const int64_t rows = x.size(0), n = x.size(1);
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == n && weight.scalar_type() == x.scalar_type(),
              "weight must be a contiguous [N] tensor of x's dtype");
  auto out = at::empty(x_in.sizes(), x.options());
  at::Tensor sum, res;
  if (residual.has_value()) {
    TORCH_CHECK(residual->sizes() == x_in.sizes() && residual->scalar_type() == x.scalar_type(),
                "residual must match x");
    res = as_rows(*residual);
    sum = at::empty(x_in.sizes(), x.options());
  }
#define IMPASTO_NORM(T)                                                                        \
  rms_norm_rows<T>(cdata<T>(x), x.stride(0), res.defined() ? cdata<T>(res) : nullptr,          \
                   res.defined() ? res.stride(0) : 0, sum.defined() ? mdata<T>(sum) : nullptr, \
                   cdata<T>(weight), mdata<T>(out), rows, n, eps, gemma)
  if (x.scalar_type() == at::kBFloat16) IMPASTO_NORM(bf16);
  else if (x.scalar_type() == at::kFloat) IMPASTO_NORM(float);
  else TORCH_CHECK(false, "add_rms_norm: float32 or bfloat16 only");
#undef IMPASTO_NORM
  return {out, sum};
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps, bool gemma) {
  return std::get<0>(norm_impl(x, std::nullopt, weight, eps, gemma));
}

// Returns (norm(x + residual), x + residual).
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                                const at::Tensor& weight, double eps, bool gemma) {
  return norm_impl(x, residual, weight, eps, gemma);
}

// ---------------------------------------------------------------- SwiGLU: silu(gate) * up
// Inner loops live in functions of their own, with restrict pointers and sizes by value: inside
// a parallel_for lambda GCC reloads captured values every iteration and does not vectorize.
template <typename T>
void silu_mul_row(const T* __restrict g, const T* __restrict u, T* __restrict o, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const float gi = to_f(g[i]);
    o[i] = from_f<T>(gi / (1.0f + fast_exp(-gi)) * to_f(u[i]));
  }
}

template <typename T>
void silu_mul_rows(const T* x, int64_t xs, T* out, int64_t rows, int64_t n) {
  at::parallel_for(0, rows, grain_rows(2 * n), [=](int64_t lo, int64_t hi) {
    for (int64_t t = lo; t < hi; ++t) silu_mul_row(x + t * xs, x + t * xs + n, out + t * n, n);
  });
}

at::Tensor silu_and_mul(const at::Tensor& gate_up) {
  check_rows(gate_up, "gate_up");
  TORCH_CHECK(gate_up.size(1) % 2 == 0, "gate_up must have an even width");
  const int64_t rows = gate_up.size(0), n = gate_up.size(1) / 2;
  auto out = at::empty({rows, n}, gate_up.options());
  if (gate_up.scalar_type() == at::kBFloat16)
    silu_mul_rows<bf16>(cdata<bf16>(gate_up), gate_up.stride(0),
                            mdata<bf16>(out), rows, n);
  else if (gate_up.scalar_type() == at::kFloat)
    silu_mul_rows<float>(cdata<float>(gate_up), gate_up.stride(0),
                         mdata<float>(out), rows, n);
  else TORCH_CHECK(false, "silu_and_mul: float32 or bfloat16 only");
  return out;
}

// ---------------------------------------------------------------- rotary, in place
// x [T, H, D] (D contiguous); table [2, T, 1, rot] = (cos | cos, -sin | sin) in x's dtype:
// x[:rot] <- x[:rot] * table[0] + roll(x[:rot], rot / 2) * table[1]; x[rot:] untouched.
template <typename T>
void rotary_rows(T* x, int64_t ts, int64_t hs, int64_t rows, int64_t heads, const T* table,
                 int64_t rot) {
  const int64_t half = rot / 2;
  const T* cos = table;
  const T* sin = table + rows * rot;
  at::parallel_for(0, rows, grain_rows(heads * rot), [&](int64_t lo, int64_t hi) {
    std::vector<float> buf(rot);
    for (int64_t t = lo; t < hi; ++t) {
      const T* c = cos + t * rot;
      const T* s = sin + t * rot;
      for (int64_t h = 0; h < heads; ++h) {
        T* xr = x + t * ts + h * hs;
        load_row(xr, buf.data(), rot);
        for (int64_t i = 0; i < rot; ++i) {
          const float other = buf[i < half ? i + half : i - half];
          xr[i] = from_f<T>(buf[i] * to_f(c[i]) + other * to_f(s[i]));
        }
      }
    }
  });
}

void rotary_(at::Tensor x, const at::Tensor& table) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1, "rotary_: x must be [T, H, D], D contiguous");
  TORCH_CHECK(table.dim() == 4 && table.is_contiguous() && table.size(0) == 2 &&
                  table.size(1) == x.size(0) && table.size(3) <= x.size(2) && table.size(3) % 2 == 0,
              "rotary_: table must be a contiguous [2, T, 1, rot] tensor");
  TORCH_CHECK(table.scalar_type() == x.scalar_type(), "rotary_: table dtype must match x");
  const int64_t rot = table.size(3);
  if (x.scalar_type() == at::kBFloat16)
    rotary_rows<bf16>(mdata<bf16>(x), x.stride(0), x.stride(1), x.size(0),
                          x.size(1), cdata<bf16>(table), rot);
  else if (x.scalar_type() == at::kFloat)
    rotary_rows<float>(mdata<float>(x), x.stride(0), x.stride(1), x.size(0),
                       x.size(1), cdata<float>(table), rot);
  else TORCH_CHECK(false, "rotary_: float32 or bfloat16 only");
}

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
  auto prefetch_row = [&](const T* base, int64_t b, int64_t k, int64_t h) {
    const int64_t slot = bt[b * bts + k / a.bs] * a.bs + k % a.bs;
    const char* p = reinterpret_cast<const char*>(base + slot * row + h * d);
    for (int64_t off = 0; off < d * static_cast<int64_t>(sizeof(T)); off += 64) _mm_prefetch(p + off, _MM_HINT_T0);
  };
  at::parallel_for(0, num_reqs * a.hkv * parts, 1, [&](int64_t lo, int64_t hi) {
    std::vector<float> qf, sc, acc, denom, kv(d);
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
      for (int64_t k = all_lo; k < all_hi; ++k) {  // scores: one K row feeds every query row
        if (k + kAhead < all_hi) prefetch_row(kc, b, k + kAhead, h);
        else if (all_lo + k + kAhead - all_hi < all_hi) prefetch_row(vc, b, all_lo + k + kAhead - all_hi, h);  // first V rows
        const int64_t slot = bt[b * bts + k / a.bs] * a.bs + k % a.bs;
        load_row(kc + slot * row + h * d, kv.data(), d);
        for (int64_t r = 0; r < nrows; ++r) {
          float s = dot(qf.data() + r * d, kv.data(), d);
          if (a.softcap > 0) s = std::tanh(s / (float)a.softcap) * (float)a.softcap;
          sc[r * len + k] = s;
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
      for (int64_t k = all_lo; k < all_hi; ++k) {  // P @ V: one V row feeds every query row
        if (k + kAhead < all_hi) prefetch_row(vc, b, k + kAhead, h);
        const int64_t slot = bt[b * bts + k / a.bs] * a.bs + k % a.bs;
        load_row(vc + slot * row + h * d, kv.data(), d);
        for (int64_t r = 0; r < nrows; ++r) {
          const float p = sc[r * len + k];
          if (p == 0.0f) continue;
          float* o = acc.data() + r * d;
          for (int64_t e = 0; e < d; ++e) o[e] += p * kv[e];
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

// Any leading shape: [..., I] -> [..., O].
at::Tensor linear_bf16(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() >= 1, "linear_bf16: x must have at least one dimension");
  auto shape = x.sizes().vec();
  shape.back() = weight.size(0);
  if (x.numel() == 0) return at::empty(shape, x.options());  // (an empty x may have any strides)
  auto y = linear_2d(as_rows(x), weight, bias);
  return x.dim() == 2 ? y : y.view(shape);
}

// ---------------------------------------------------------------- a stack of decoder layers
// Llama-family decoder layers (Llama, Mistral, Qwen2, Qwen3) for short-query steps, in one call:
// the same kernels, in the same order, as the per-module path (so the results are identical),
// without ~25 Python module calls and op dispatches per layer around them (~6 ms of a 20 ms
// batch-1 step of a 30-layer model). x [T, hidden] are the embeddings; returns (the last MLP
// output, the residual stream), whose sum the final norm takes. Per layer, `weights` holds
// kLayerFields entries (absent ones None), in the order of the LayerField enum (see
// StackLayer in decoder_stack.py); kv_caches and windows are per layer.
//
// Packed GGUF weights: a linear field whose weight is packed is None in `weights`; its row
// segments come from `packed` in order, described by `packed_meta`: for every layer, for each
// of its four linear fields (qkv, o, gate_up, down), the segment count n (0 = dense), then the
// n GGML types.
enum LayerField {
  kInNorm, kQkvW, kQkvB, kQNorm, kKNorm, kOW, kOB, kPostNorm, kGateUpW, kGateUpB, kDownW, kDownB,
  kLayerFields
};

// One linear layer's weight: dense bf16, or packed row segments.
struct StackLinear {
  std::optional<at::Tensor> dense;
  std::vector<at::Tensor> segments;
  std::vector<int64_t> qtypes;

  at::Tensor operator()(const at::Tensor& x, const std::optional<at::Tensor>& bias) const {
    if (dense.has_value()) return linear_2d(x, *dense, bias);
    return impasto_quant::linear_segments(x, segments, qtypes, bias);
  }
};

std::tuple<at::Tensor, at::Tensor> decoder_layers(
    const at::Tensor& x_in, const at::Tensor& table,
    const c10::List<std::optional<at::Tensor>>& weights, at::TensorList packed,
    at::IntArrayRef packed_meta, at::TensorList kv_caches,
    const at::Tensor& slot_mapping, const at::Tensor& block_table,
    const at::Tensor& query_start_loc, const at::Tensor& seq_lens, const at::Tensor& causal,
    int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double eps, double scale,
    at::IntArrayRef windows) {
  const int64_t layers = static_cast<int64_t>(kv_caches.size());
  TORCH_CHECK(static_cast<int64_t>(weights.size()) == layers * kLayerFields &&
                  static_cast<int64_t>(windows.size()) == layers,
              "decoder_layers: expected ", kLayerFields, " weights and one window per layer");
  check_rows(x_in, "x");
  TORCH_CHECK(x_in.scalar_type() == at::kBFloat16, "decoder_layers: bfloat16 only");
  // Resolve every layer's four linear weights (dense or packed) up front.
  constexpr LayerField kLinears[4] = {kQkvW, kOW, kGateUpW, kDownW};
  std::vector<std::array<StackLinear, 4>> linears(layers);
  size_t meta = 0, seg = 0;
  for (int64_t l = 0; l < layers; ++l)
    for (int f = 0; f < 4; ++f) {
      StackLinear& lin = linears[l][f];
      TORCH_CHECK(meta < packed_meta.size(), "decoder_layers: packed_meta too short");
      const int64_t n = packed_meta[meta++];
      if (n == 0) {
        lin.dense = weights.get(l * kLayerFields + kLinears[f]);
        TORCH_CHECK(lin.dense.has_value(), "decoder_layers: a linear weight is neither dense nor packed");
        continue;
      }
      for (int64_t i = 0; i < n; ++i) {
        TORCH_CHECK(meta < packed_meta.size() && seg < packed.size(), "decoder_layers: packed segments missing");
        lin.qtypes.push_back(packed_meta[meta++]);
        lin.segments.push_back(packed[seg++]);
      }
    }
  TORCH_CHECK(meta == packed_meta.size() && seg == packed.size(), "decoder_layers: packed_meta disagrees with packed");
  const int64_t t = x_in.size(0), hq = num_heads, hkv = num_kv_heads, d = head_dim;
  at::Tensor x = x_in, residual;  // the residual stream starts as the embeddings (layer 0)
  for (int64_t l = 0; l < layers; ++l) {
    auto w = [&](LayerField f) { return weights.get(l * kLayerFields + f); };
    const auto& lin = linears[l];
    at::Tensor h;
    if (residual.defined()) {
      std::tie(h, residual) = norm_impl(x, residual, *w(kInNorm), eps, false);
    } else {
      h = std::get<0>(norm_impl(x, std::nullopt, *w(kInNorm), eps, false));
      residual = x;
    }
    // [T, (Hq + 2 Hkv) * D] -> [T, Hq + 2 Hkv, D]: q heads, k heads, v heads
    const at::Tensor qkv = lin[0](h, w(kQkvB)).view({t, hq + 2 * hkv, d});
    at::Tensor q = qkv.narrow(1, 0, hq), k = qkv.narrow(1, hq, hkv);
    const at::Tensor v = qkv.narrow(1, hq + hkv, hkv);
    if (w(kQNorm).has_value()) {  // Qwen3: per-head RMSNorm, then rotary on the normed copies
      q = std::get<0>(norm_impl(q, std::nullopt, *w(kQNorm), eps, false));
      k = std::get<0>(norm_impl(k, std::nullopt, *w(kKNorm), eps, false));
      rotary_(q, table);
      rotary_(k, table);
    } else {  // q and k heads are adjacent: one rotary call over [T, Hq + Hkv, D]
      rotary_(qkv.narrow(1, 0, hq + hkv), table);
    }
    const at::Tensor attn = paged_attention(q, k, v, kv_caches[l], slot_mapping, block_table,
                                            query_start_loc, seq_lens, causal, scale, windows[l], 0.0);
    const at::Tensor o = lin[1](attn, w(kOB));
    std::tie(h, residual) = norm_impl(o, residual, *w(kPostNorm), eps, false);
    const at::Tensor act = silu_and_mul(lin[2](h, w(kGateUpB)));
    x = lin[3](act, w(kDownB));
  }
  return {x, residual};
}

}  // namespace

TORCH_LIBRARY(impasto, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps, bool gemma) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps, bool gemma) -> (Tensor, Tensor)");
  m.def("silu_and_mul(Tensor gate_up) -> Tensor");
  m.def("linear_bf16(Tensor x, Tensor weight, Tensor? bias=None) -> Tensor");
  m.def("rotary_(Tensor(a!) x, Tensor table) -> ()");
  m.def(
      "paged_attention(Tensor q, Tensor k, Tensor v, Tensor(a!) kv_cache, Tensor slot_mapping, "
      "Tensor block_table, Tensor query_start_loc, Tensor seq_lens, Tensor causal, float scale, "
      "int window, float softcap) -> Tensor");
  m.def(
      "decoder_layers(Tensor x, Tensor table, Tensor?[] weights, Tensor[] packed, int[] packed_meta, "
      "Tensor(a!)[] kv_caches, Tensor slot_mapping, Tensor block_table, Tensor query_start_loc, "
      "Tensor seq_lens, Tensor causal, int num_heads, int num_kv_heads, int head_dim, float eps, "
      "float scale, int[] windows) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(impasto, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("silu_and_mul", &silu_and_mul);
  m.impl("linear_bf16", &linear_bf16);
  m.impl("rotary_", &rotary_);
  m.impl("paged_attention", &paged_attention);
  m.impl("decoder_layers", &decoder_layers);
}
