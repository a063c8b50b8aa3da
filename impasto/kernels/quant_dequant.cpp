// Packed GGML rows to float: the scalar dequantization of every supported type (dequant_row),
// and the op `quant_embedding`, which looks up token rows of a packed embedding table with it.
// The float matmul kernel (quant_float.cpp: float32 models, builds without AVX2) dequantizes
// weight rows with it too.
//
// Invariant: the float32 rows are the gguf package's dequantization, bit for bit (tests/kernels
// check every type); bfloat16 rows are those rounded once. One row is dequantized at a time, so
// a lookup's result does not depend on the other ids of the call.
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <vector>

#include "quant_rows.h"

namespace impasto_quant {

// ---------------------------------------------------------------- dequantization
// One row of `n` values to float32: embedding lookups, and the float matmul kernel.
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
          const int shift = 4 * (j % 2);
          float* yj = yb + 32 * j;
          // branch-free inner loops (one per type), so that they vectorize
          if (qh == nullptr)
            for (int l = 0; l < 32; ++l) yj[l] = ds * static_cast<float>((q[l] >> shift) & 0xF) - dm;
          else
            for (int l = 0; l < 32; ++l)
              yj[l] = ds * static_cast<float>(((q[l] >> shift) & 0xF) | (((qh[l] >> j) & 1) << 4)) - dm;
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
          // quarter s of the 128 values: low nibbles of ql[0..32) / ql[32..64) (s = 0, 1), then
          // their high nibbles (s = 2, 3), bits 2s..2s+1 of qh on top; a scale per 16 values
          for (int s = 0; s < 4; ++s) {
            const uint8_t* lo = ql + 32 * (s % 2);
            const int shift = 4 * (s / 2);
            for (int g = 0; g < 2; ++g) {
              const float dsc = d * static_cast<float>(sc[2 * s + g]);
              for (int l = 16 * g; l < 16 * g + 16; ++l) {
                const int v = ((lo[l] >> shift) & 0xF) | (((qh[l] >> (2 * s)) & 3) << 4);
                yh[l + 32 * s] = dsc * static_cast<float>(v - 32);
              }
            }
          }
        }
      }
      return;
    default: TORCH_CHECK(false, "packed weights: unsupported GGML type ", qtype);
  }
}

namespace {

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

}  // namespace
}  // namespace impasto_quant

TORCH_LIBRARY_FRAGMENT(impasto, m) {
  m.def("quant_embedding(Tensor ids, Tensor blocks, int qtype, int cols, ScalarType dtype) -> Tensor");
}

TORCH_LIBRARY_IMPL(impasto, CPU, m) { m.impl("quant_embedding", &impasto_quant::quant_embedding); }
