// Shared by the 16-bit layer kernels: cpu_ops.cpp (norms, SwiGLU, rotary, the decoder stack),
// cpu_attention.cpp (paged attention) and cpu_linear.cpp (the skinny bf16 linear). Tensor data
// as raw bf16 bits (see vec_math.h), the row checks, and the two ops of the other files that the
// decoder stack calls directly.
//
// Layout conventions (checked on entry):
//   rows   [T, N]               last dim contiguous, any row stride
//   heads  [T, H, D]            D contiguous (views into a fused qkv projection are fine)
//   cache  [2, NB, bs, Hkv, D]  contiguous; slot s = block * bs + offset
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>

#include <cstdint>
#include <optional>
#include <type_traits>

#include "vec_math.h"

namespace impasto_cpu {

using impasto_vec::bf16;

template <typename T> const T* cdata(const at::Tensor& t) {
  if constexpr (std::is_same_v<T, bf16>) return reinterpret_cast<const bf16*>(t.const_data_ptr<c10::BFloat16>());
  else return t.const_data_ptr<T>();
}
template <typename T> T* mdata(const at::Tensor& t) {
  if constexpr (std::is_same_v<T, bf16>) return reinterpret_cast<bf16*>(t.mutable_data_ptr<c10::BFloat16>());
  else return t.mutable_data_ptr<T>();
}

inline void check_rows(const at::Tensor& x, const char* name) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, name, " must be [T, N] with a contiguous last dim");
}

// [..., N] -> [rows, N] with a contiguous last dim: a view where the strides allow (2-D rows
// of a wider buffer stay views), else a copy. Row kernels take any leading shape through it.
inline at::Tensor as_rows(const at::Tensor& x) {
  TORCH_CHECK(x.dim() >= 1, "expected a tensor with at least one dimension");
  if (x.dim() == 2 && x.stride(1) == 1) return x;
  return (x.stride(-1) == 1 ? x : x.contiguous()).reshape({-1, x.size(-1)});
}

// cpu_attention.cpp: writes the step's k/v at slot_mapping, then attends every request's
// queries over its cached keys (the op impasto::paged_attention).
at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                           at::Tensor kv_cache, const at::Tensor& slot_mapping,
                           const at::Tensor& block_table, const at::Tensor& query_start_loc,
                           const at::Tensor& seq_lens, const at::Tensor& causal, double scale,
                           int64_t window, double softcap);

// cpu_linear.cpp: y [T, O] = x [T, I] @ weight[O, I]^T (+ bias), all bfloat16, x as rows.
at::Tensor linear_2d(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias);

}  // namespace impasto_cpu
