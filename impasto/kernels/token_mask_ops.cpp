// Grammar token masks on logits (structured outputs), in place.
//
// `apply_token_bitmask_(logits [N, V], bitmask [N, W] int32)`: bit (t % 32) of word t / 32 of a
// row clear means token t is not allowed, and its logit becomes -inf; tokens at or beyond
// 32 * W are not allowed. Words that are all ones (everything allowed, most words of a string
// state) are skipped, so the cost is one pass over the mask plus the refused logits. float32
// and bfloat16 logits. Eager PyTorch needs an unpack to [N, V] bits and a masked fill (~0.1 ms
// a row for a 49k vocabulary); this is a few microseconds.
#include <torch/extension.h>

#include <cstdint>
#include <limits>

namespace {

template <typename T>
void mask_rows(T* logits, const int32_t* bits, int64_t n, int64_t v, int64_t w,
               int64_t ls, int64_t bs) {
  const T neg = -std::numeric_limits<T>::infinity();
  at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      T* row = logits + r * ls;
      const int32_t* words = bits + r * bs;
      for (int64_t i = 0; i < w && i * 32 < v; ++i) {
        const uint32_t word = static_cast<uint32_t>(words[i]);
        if (word == 0xffffffffu) continue;
        const int64_t base = i * 32, top = std::min<int64_t>(32, v - base);
        for (int64_t b = 0; b < top; ++b)
          if (!((word >> b) & 1u)) row[base + b] = neg;
      }
      for (int64_t t = w * 32; t < v; ++t) row[t] = neg;
    }
  });
}

void apply_token_bitmask_(at::Tensor& logits, const at::Tensor& bitmask) {
  TORCH_CHECK(logits.dim() == 2 && bitmask.dim() == 2, "apply_token_bitmask_: 2-D tensors");
  TORCH_CHECK(logits.size(0) == bitmask.size(0), "apply_token_bitmask_: row counts differ");
  TORCH_CHECK(bitmask.scalar_type() == at::kInt, "apply_token_bitmask_: the mask is int32");
  TORCH_CHECK(logits.stride(1) == 1 && bitmask.stride(1) == 1,
              "apply_token_bitmask_: rows must be contiguous");
  const int64_t n = logits.size(0), v = logits.size(1), w = bitmask.size(1);
  const int32_t* bits = bitmask.data_ptr<int32_t>();
  if (logits.scalar_type() == at::kFloat) {
    mask_rows(logits.data_ptr<float>(), bits, n, v, w, logits.stride(0), bitmask.stride(0));
  } else if (logits.scalar_type() == at::kBFloat16) {
    mask_rows(logits.data_ptr<at::BFloat16>(), bits, n, v, w, logits.stride(0),
              bitmask.stride(0));
  } else {
    TORCH_CHECK(false, "apply_token_bitmask_: float32 or bfloat16 logits");
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(impasto, m) {
  m.def("apply_token_bitmask_(Tensor(a!) logits, Tensor bitmask) -> ()");
}

TORCH_LIBRARY_IMPL(impasto, CPU, m) { m.impl("apply_token_bitmask_", &apply_token_bitmask_); }
