// The interleaved layout of packed GGML weights (rows in groups of 8): one record per (group,
// block) holding each GGML field of the 8 rows, field by field. Written once by the repacking
// (quant_x8_repack.cpp), read by the kernels (quant_x8.cpp); see quant_x8.cpp for why.
//
// Invariant: a record is 8 GGML blocks' bytes, rearranged (static_asserts below), except Q4_K's,
// whose 6-bit scales and mins are unpacked to bytes (+32 bytes a record, 2.8 %).
#pragma once

#include "quant_blocks.h"

namespace impasto_quant::x8 {

#pragma pack(push, 1)
// [g][r][k]: byte k of lane r (weight row r) in 4-byte group g.
struct X8Q4_0 { uint16_t d[8]; uint8_t qs[4][8][4]; };
struct X8Q4_1 { uint16_t d[8], m[8]; uint8_t qs[4][8][4]; };
// qh[r][k]: bit 2g = fifth bit of value 4g + k, bit 2g + 1 = of value 16 + 4g + k.
struct X8Q5_0 { uint16_t d[8]; uint8_t qh[8][4]; uint8_t qs[4][8][4]; };
struct X8Q5_1 { uint16_t d[8], m[8]; uint8_t qh[8][4]; uint8_t qs[4][8][4]; };
struct X8Q8_0 { uint16_t d[8]; int8_t qs[8][8][4]; };
// Q4_K: chunk c of 64 values: low nibbles = sub-block 2c, high = 2c + 1 (GGML's order).
// sc[j][r]: sub-block j's 6-bit scale; mn[i][r] = the mins of sub-blocks 2i and 2i + 1.
struct X8Q4_K { uint16_t d[8], dmin[8]; uint8_t sc[8][8]; uint8_t mn[4][8][2]; uint8_t qs[4][8][8][4]; };
// Q6_K, values u = q + 32 in [0, 63] in natural order, chunk c after chunk c (read in address
// order: hardware prefetchers follow one stream, not two): ch[c].ql[g][r][k] low nibble = low 4
// bits of value 64c + 4g + k, high nibble = of 64c + 32 + 4g + k; ch[c].qh[g / 2][r][k] bits
// 4 (g % 2) + 2h, + 1 = top 2 bits of value 64c + 32h + 4g + k; sc[i][r] = scales 2i, 2i + 1
// (scale s covers values 16s .. 16s + 15).
struct X8Q6_KChunk { uint8_t ql[8][8][4]; uint8_t qh[4][8][4]; };
struct X8Q6_K { uint16_t d[8]; int8_t sc[8][8][2]; X8Q6_KChunk ch[4]; };
#pragma pack(pop)
static_assert(sizeof(X8Q4_0) == 8 * sizeof(BlockQ4_0) && sizeof(X8Q4_1) == 8 * sizeof(BlockQ4_1));
static_assert(sizeof(X8Q5_0) == 8 * sizeof(BlockQ5_0) && sizeof(X8Q5_1) == 8 * sizeof(BlockQ5_1));
static_assert(sizeof(X8Q8_0) == 8 * sizeof(BlockQ8_0));
static_assert(sizeof(X8Q4_K) == 8 * sizeof(BlockQ4_K) + 32);  // scales unpacked: 16 bytes a row, not 12
static_assert(sizeof(X8Q6_K) == 8 * sizeof(BlockQ6_K));
}  // namespace impasto_quant::x8
