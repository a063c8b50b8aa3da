// Fused CPU kernels for the 16-bit decode path (see impasto/kernels/__init__.py): RMSNorm
// (+ residual add), SwiGLU and rotary, and the stack of decoder layers that chains them with
// the bf16 linear (cpu_linear.cpp) and paged attention (cpu_attention.cpp). Helpers shared with
// those files are in cpu_ops.h and vec_math.h. This file also defines the op library
// (TORCH_LIBRARY); the other kernel files add their ops to it as fragments.
//
// Why: a batch-1 decode step of a 135M model is ~9 ms of weight streaming and, in eager
// PyTorch, ~400 more small kernels (norms, rotary, cache writes, attention pieces), each paying
// dispatch and allocation costs that exceed its arithmetic. These kernels do each group of them
// in one call. All arithmetic is float32; 16-bit values are rounded once on store (round to
// nearest even), so results are at least as accurate as the eager bf16 path, not bit-identical.
//
// Layout conventions: see cpu_ops.h (checked on entry).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <optional>
#include <tuple>
#include <vector>

#include "cpu_ops.h"
#include "quant_ops.h"
#include "vec_math.h"

namespace {

using impasto_cpu::as_rows;
using impasto_cpu::bf16;
using impasto_cpu::cdata;
using impasto_cpu::check_rows;
using impasto_cpu::linear_2d;
using impasto_cpu::mdata;
using impasto_cpu::paged_attention;
using impasto_vec::dot;
using impasto_vec::fast_exp;
using impasto_vec::from_f;
using impasto_vec::load_row;
using impasto_vec::to_f;

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
  m.def("rotary_(Tensor(a!) x, Tensor table) -> ()");
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
  m.impl("rotary_", &rotary_);
  m.impl("decoder_layers", &decoder_layers);
}
