// Repacking packed GGML weights into the interleaved layout (quant_x8_layout.h), scalar, once
// per weight when the kernels are installed. Quant bits and half scales are copied unchanged;
// only Q4_K's scales are unpacked and Q6_K's / Q5_x's high bits regrouped, so the kernels'
// integer sums are those of the GGML rows.
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>

#include "quant_x8.h"
#include "quant_x8_layout.h"

namespace impasto_quant {
namespace {
using namespace x8;

// Block b of weight row r of the group starting at `src` (rows `row_bytes` apart).
template <typename Blk>
const Blk& src_block(const uint8_t* src, int64_t row_bytes, int r, int64_t b) {
  return reinterpret_cast<const Blk*>(src + r * row_bytes)[b];
}

template <typename X, typename Blk>
void repack_32(const uint8_t* src, int64_t row_bytes, int64_t b, X& out) {
  for (int r = 0; r < 8; ++r) {
    const Blk& s = src_block<Blk>(src, row_bytes, r, b);
    out.d[r] = s.d;
    if constexpr (requires { out.m; }) out.m[r] = s.m;
    constexpr int groups = sizeof(out.qs) / 32;  // 4-byte groups per lane: 4 (nibbles) or 8
    for (int g = 0; g < groups; ++g) std::memcpy(out.qs[g][r], s.qs + 4 * g, 4);
    if constexpr (requires { out.qh; }) {
      uint32_t bits;
      std::memcpy(&bits, s.qh, 4);
      for (int k = 0; k < 4; ++k) {
        uint8_t v = 0;
        for (int g = 0; g < 4; ++g) {
          v |= static_cast<uint8_t>(((bits >> (4 * g + k)) & 1u) << (2 * g));
          v |= static_cast<uint8_t>(((bits >> (16 + 4 * g + k)) & 1u) << (2 * g + 1));
        }
        out.qh[r][k] = v;
      }
    }
  }
}

void repack_q4k(const uint8_t* src, int64_t row_bytes, int64_t b, X8Q4_K& out) {
  for (int r = 0; r < 8; ++r) {
    const BlockQ4_K& s = src_block<BlockQ4_K>(src, row_bytes, r, b);
    out.d[r] = s.d;
    out.dmin[r] = s.dmin;
    for (int j = 0; j < 8; ++j) {
      int sc, m;
      scale_min_k4(j, s.scales, sc, m);
      out.sc[j][r] = static_cast<uint8_t>(sc);
      out.mn[j / 2][r][j % 2] = static_cast<uint8_t>(m);
    }
    for (int c = 0; c < 4; ++c)
      for (int g = 0; g < 8; ++g) std::memcpy(out.qs[c][g][r], s.qs + 32 * c + 4 * g, 4);
  }
}

void repack_q6k(const uint8_t* src, int64_t row_bytes, int64_t b, X8Q6_K& out) {
  for (int r = 0; r < 8; ++r) {
    const BlockQ6_K& s = src_block<BlockQ6_K>(src, row_bytes, r, b);
    uint8_t u[256];  // GGML's Q6_K order: value 128n + 32j + l
    for (int v = 0; v < 256; ++v) {
      const int n = v / 128, j = (v % 128) / 32, l = v % 32;
      const uint8_t ql = s.ql[64 * n + l + 32 * (j & 1)];
      const int lo4 = j < 2 ? ql & 0xF : ql >> 4;
      u[v] = static_cast<uint8_t>(lo4 | ((s.qh[32 * n + l] >> (2 * j)) & 3) << 4);
    }
    out.d[r] = s.d;
    for (int i = 0; i < 8; ++i) out.sc[i][r][0] = s.scales[2 * i], out.sc[i][r][1] = s.scales[2 * i + 1];
    for (int c = 0; c < 4; ++c) {
      for (auto& q : out.ch[c].qh) std::memset(q[r], 0, 4);
      for (int g = 0; g < 8; ++g)
        for (int k = 0; k < 4; ++k) {
          const int lo = u[64 * c + 4 * g + k], hi = u[64 * c + 32 + 4 * g + k];
          out.ch[c].ql[g][r][k] = static_cast<uint8_t>((lo & 0xF) | (hi & 0xF) << 4);
          out.ch[c].qh[g / 2][r][k] |= static_cast<uint8_t>(((lo >> 4) | (hi >> 4) << 2) << (4 * (g % 2)));
        }
    }
  }
}

template <typename X>
void repack_all(const uint8_t* src, int64_t rows, int64_t row_bytes, int64_t nb, X* dst,
                void (*one)(const uint8_t*, int64_t, int64_t, X&)) {
  at::parallel_for(0, rows / 8, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t g = lo; g < hi; ++g)
      for (int64_t b = 0; b < nb; ++b) one(src + 8 * g * row_bytes, row_bytes, b, dst[g * nb + b]);
  });
}

}  // namespace

int64_t x8_group_bytes(int64_t qtype, int64_t cols) {
  const TypeInfo ti = type_info(qtype);
  const int64_t record = qtype == kQ4_K ? static_cast<int64_t>(sizeof(X8Q4_K)) : 8 * ti.bytes;
  return cols / ti.elems * record;
}

at::Tensor x8_repack(const at::Tensor& blocks, int64_t qtype) {
  TORCH_CHECK(x8_supported(qtype), "quant_repack: no interleaved kernels for GGML type ", qtype, " in this build");
  TORCH_CHECK(blocks.scalar_type() == at::kByte && blocks.dim() == 2 && blocks.is_contiguous() && blocks.size(0) % 8 == 0,
              "quant_repack: blocks must be contiguous uint8 [rows, row_bytes] with rows a multiple of 8");
  const TypeInfo ti = type_info(qtype);
  const int64_t rows = blocks.size(0), row_bytes = blocks.size(1);
  TORCH_CHECK(row_bytes % ti.bytes == 0, "quant_repack: rows of ", row_bytes, " bytes are not whole blocks of type ", qtype);
  const int64_t nb = row_bytes / ti.bytes;
  auto out = at::empty({rows / 8, x8_group_bytes(qtype, nb * ti.elems)}, blocks.options());
  const uint8_t* src = blocks.const_data_ptr<uint8_t>();
  uint8_t* dst = out.mutable_data_ptr<uint8_t>();
  switch (qtype) {
    case kQ4_0: repack_all<X8Q4_0>(src, rows, row_bytes, nb, reinterpret_cast<X8Q4_0*>(dst), repack_32<X8Q4_0, BlockQ4_0>); break;
    case kQ4_1: repack_all<X8Q4_1>(src, rows, row_bytes, nb, reinterpret_cast<X8Q4_1*>(dst), repack_32<X8Q4_1, BlockQ4_1>); break;
    case kQ5_0: repack_all<X8Q5_0>(src, rows, row_bytes, nb, reinterpret_cast<X8Q5_0*>(dst), repack_32<X8Q5_0, BlockQ5_0>); break;
    case kQ5_1: repack_all<X8Q5_1>(src, rows, row_bytes, nb, reinterpret_cast<X8Q5_1*>(dst), repack_32<X8Q5_1, BlockQ5_1>); break;
    case kQ8_0: repack_all<X8Q8_0>(src, rows, row_bytes, nb, reinterpret_cast<X8Q8_0*>(dst), repack_32<X8Q8_0, BlockQ8_0>); break;
    case kQ4_K: repack_all<X8Q4_K>(src, rows, row_bytes, nb, reinterpret_cast<X8Q4_K*>(dst), repack_q4k); break;
    case kQ6_K: repack_all<X8Q6_K>(src, rows, row_bytes, nb, reinterpret_cast<X8Q6_K*>(dst), repack_q6k); break;
    default: break;
  }
  return out;
}

}  // namespace impasto_quant
