// The bf16 SGMV blocks on CPUs with AVX512-BF16 but no AMX (AMD Zen 4 and later, Intel Cooper Lake):
// `vdpbf16ps` multiplies 16 pairs of bf16 values and adds both products of each pair to one fp32 lane.
// On Zen 4 it issues at the rate of an fp32 FMA (one 512-bit op a cycle) with twice the multiply-adds, and
// reads bf16 as it is stored: no widening of x, A or B to fp32 first (on Intel's AMX CPUs it runs at half
// the FMA rate, and AMX's tiles take these shapes instead: `sgmv_amx.h`).
//
// For a chunk of m <= 16 token rows of one adapter slot, the same sums as the AMX path:
// - shrink, per block of 4 token rows x 4 rank rows (2 x 8, 1 x 16 for the last rows of a chunk):
//   C[u][j] = sum_d x[u][d] * a[j][d], 32 values of d per step (16 lanes, each the sum of one pair), the
//   lanes then reduced by one shuffle tree (`loragate_sgmv::reduce_lanes`); v[u][j] = bf16(scale * C[u][j]).
// - expand, per 4 token rows x 64 outputs (2 x 128, 1 x 256):
//   C[u][o] = sum_p v[u][2p] * b[2p][o] + v[u][2p + 1] * b[2p + 1][o],
//   B read in rank pairs per 16 outputs (the layout the adapter cache keeps beside B,
//   `kernels.sgmv_native.slot_pairs`), v's pair broadcast to every lane; y[u][o] = bf16(y[u][o] + C[u][o]).
// Every sum runs over its reduction dimension in one fixed order whatever m is, so a token's result never
// depends on the batch around it. `vdpbf16ps` treats bf16 subnormals (below 1.2e-38) as zero.
#pragma once

#include <ATen/ATen.h>

#include "sgmv_blocks.h"

#include <algorithm>
#include <cstdint>
#include <cstring>

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#define LORAGATE_DPBF16 1
#include <immintrin.h>
#else
#define LORAGATE_DPBF16 0
#endif

namespace loragate_dpbf16 {

using bf16 = at::BFloat16;

// Whether this build multiplies bf16 pairs in hardware (`-march=native` on a CPU with AVX512-BF16).
constexpr bool ready() { return LORAGATE_DPBF16 != 0; }

// Shapes this path takes: rows of whole 32-value steps, outputs in blocks of 16 (B's pairs), any rank
// (v's rows are padded to whole pairs with a zero).
inline bool fits(int64_t in, int64_t outs, int64_t r) { return in % 32 == 0 && outs % 16 == 0 && r > 0; }

using loragate_sgmv::v_row;

#if LORAGATE_DPBF16

constexpr int64_t ACC = 16;      // accumulators per block: token rows x rank rows (shrink), x blocks of outputs
constexpr int64_t AHEAD = 128;   // how far ahead along its first rows the shrink prefetches A, in values

inline __m512bh load_bh(const bf16* p) { return reinterpret_cast<__m512bh>(_mm512_loadu_si512(p)); }

// Token rows per block for the `left` rows still to do: 4, else 2, else 1. A chunk of few rows (a decode
// step's segment of one adapter often holds one or two tokens) then computes no copies of rows it lacks.
// The block's shape does not change any sum: each (u, j) or (u, o) is summed in the same order in any.
template <typename F>
inline void by_tiles(int64_t m, F&& f) {
  int64_t t0 = 0;
  for (; t0 + 4 <= m; t0 += 4) f.template operator()<4>(t0);
  if (t0 + 2 <= m) f.template operator()<2>(t0), t0 += 2;
  if (t0 < m) f.template operator()<1>(t0);
}

// store(u, j, C[u][j]) for u < m, j < r: the shrink of m token rows (row u at x + u * ldx) by the rank rows
// of `a` (row j at a + j * a_row), each of `in` values. A block is TILE token rows x ACC / TILE rank rows,
// its 16 sums reduced by one shuffle tree (`loragate_sgmv::reduce_lanes`, the same for every accumulator);
// a last block of fewer rank rows repeats a row it has (those sums are never stored).
template <typename Store>
inline void shrink(const bf16* x, int64_t ldx, int64_t m, const bf16* a, int64_t a_row, int64_t r, int64_t in,
                   Store&& store) {
  by_tiles(m, [&]<int64_t TILE>(int64_t t0) {
    constexpr int64_t TJ = ACC / TILE;
    for (int64_t j0 = 0; j0 < r; j0 += TJ) {
      const bf16* ar[TJ];
      const bf16* an[TJ];  // the next block's rows (prefetched meanwhile), or this block's
      const bool more = j0 + TJ < r, cold = t0 == 0 && j0 == 0;
      for (int64_t j = 0; j < TJ; ++j) ar[j] = a + (j0 + j < r ? j0 + j : j0) * a_row;
      for (int64_t j = 0; j < TJ; ++j) an[j] = a + (j0 + TJ + j < r ? j0 + TJ + j : j0) * a_row;
      __m512 acc[ACC];
      for (auto& v : acc) v = _mm512_setzero_ps();
      for (int64_t d = 0; d < in; d += 32) {
        // A comes from L3 or memory in runs too short for the hardware prefetcher: the first block's rows
        // are fetched ahead, and each block fetches the next block's lines while it computes.
        if (cold && d + AHEAD < in) {
          for (int64_t j = 0; j < TJ; ++j) __builtin_prefetch(ar[j] + d + AHEAD, 0, 3);
        }
        if (more && t0 == 0) {
          for (int64_t j = 0; j < TJ; ++j) __builtin_prefetch(an[j] + d, 0, 3);
        }
        __m512bh xv[TILE], av[TJ];
        for (int64_t u = 0; u < TILE; ++u) xv[u] = load_bh(x + (t0 + u) * ldx + d);
        for (int64_t j = 0; j < TJ; ++j) av[j] = load_bh(ar[j] + d);
        for (int64_t u = 0; u < TILE; ++u)
          for (int64_t j = 0; j < TJ; ++j) acc[u * TJ + j] = _mm512_dpbf16_ps(acc[u * TJ + j], xv[u], av[j]);
      }
      loragate_sgmv::vf lanes[ACC];
      std::memcpy(lanes, acc, sizeof(lanes));
      const loragate_sgmv::vf sums = loragate_sgmv::reduce_lanes(lanes);
      float s[ACC];
      std::memcpy(s, &sums, sizeof(s));
      for (int64_t u = 0; u < TILE; ++u)
        for (int64_t j = 0; j < TJ && j0 + j < r; ++j) store(t0 + u, j0 + j, s[u * TJ + j]);
    }
  });
}

// y[o..o+16) of one token row = bf16(y + sums), rounded to nearest even by the CPU's conversion.
inline void add_row(bf16* out, __m512 sums) {
  const __m256i old = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(out));
  const __m512 wide = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(old), 16));
  const __m256bh sum = _mm512_cvtneps_pbh(_mm512_add_ps(wide, sums));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), reinterpret_cast<const __m256i&>(sum));
}

// y[u][o] = bf16(y[u][o] + sum_j v[u * ldv + j] * b[j][o]) for u < m, o < outs; v's rows hold v_row(r) bf16
// values (a zero past an odd rank). B in rank pairs: bp[(o / 16 * pairs + p) * 32 + o % 16 * 2 + e] =
// b[2p + e][o], `pairs` = ldv / 2 per block of 16 outputs. A pass is TILE token rows x ACC / TILE blocks of
// 16 outputs (fewer at the end), v's pair broadcast to every lane.
inline void expand(bf16* y, int64_t ldy, const uint16_t* v, int64_t ldv, int64_t m, const bf16* bp, int64_t outs) {
  const int64_t pairs = ldv / 2, block = pairs * 32, blocks = outs / 16;
  by_tiles(m, [&]<int64_t TILE>(int64_t t0) {
    constexpr int64_t QV = ACC / TILE;
    const uint16_t* vt = v + t0 * ldv;
    for (int64_t q0 = 0; q0 < blocks; q0 += QV) {
      const int64_t nq = std::min<int64_t>(QV, blocks - q0);
      const bf16* b0 = bp + q0 * block;
      __m512 acc[QV][TILE];
      for (auto& row : acc)
        for (auto& c : row) c = _mm512_setzero_ps();
      const int64_t next = std::min<int64_t>(QV, blocks - q0 - nq);  // the next pass's blocks, fetched meanwhile
      for (int64_t p = 0; p < pairs; ++p) {
        if (t0 == 0) {
          for (int64_t q = 0; q < next; ++q) __builtin_prefetch(b0 + (nq + q) * block + p * 32, 0, 3);
        }
        __m512bh bv[QV];
        for (int64_t q = 0; q < nq; ++q) bv[q] = load_bh(b0 + q * block + p * 32);
        for (int64_t u = 0; u < TILE; ++u) {
          uint32_t pair;
          std::memcpy(&pair, vt + u * ldv + 2 * p, sizeof(pair));
          const __m512bh vv = reinterpret_cast<__m512bh>(_mm512_set1_epi32(static_cast<int>(pair)));
          for (int64_t q = 0; q < nq; ++q) acc[q][u] = _mm512_dpbf16_ps(acc[q][u], vv, bv[q]);
        }
      }
      for (int64_t q = 0; q < nq; ++q)
        for (int64_t u = 0; u < TILE; ++u) add_row(y + (t0 + u) * ldy + (q0 + q) * 16, acc[q][u]);
    }
  });
}

#endif  // LORAGATE_DPBF16

}  // namespace loragate_dpbf16
