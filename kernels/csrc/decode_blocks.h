// Register-blocked inner loops of the CPU paged decode attention (`paged_decode_cpu.cpp`), for head sizes
// that are a multiple of 16 (one or more vectors).
//
// Scores: per query head, a run of up to 16 keys' dots at once (D / 16 FMAs per key into one accumulator
// per key; with AVX2 8 keys at once, D / 8 FMAs each), reduced by one shuffle tree (`reduce_lanes`) and
// stored as whole vectors into a padded row. On fp32 rows (an fp32 cache's rows in place, a 16-bit cache's
// rows widened into a buffer first), or with AVX512-BF16 on a bf16 cache's rows as stored: `vdpbf16ps`, two
// of a head's D values a lane per instruction, the products exact in fp32.
// Weighted values: all the query heads of one KV head at once (GQA), so that each value vector is loaded
// (and widened, for bf16) once for all of them, with up to 16 accumulators (8 with AVX2's 16 registers).
// Each score and each output sums in the same order wherever its sequence sits in the batch.
//
// The cache is paged: a sequence's next block is anywhere in the pool, so the hardware prefetcher (which
// stops at a 4 KiB page) meets every block cold. `Ahead` fetches the next block while this one is read.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "prefetch_ahead.h"
#include "sgmv_blocks.h"
#include "sgmv_dpbf16.h"

namespace loragate_decode {

// Vectors of the target's own width (`sgmv_blocks.h`): 16 floats (one zmm) with AVX-512, else 8 (one ymm).
constexpr int NL = loragate_sgmv::VL;
using vn = loragate_sgmv::vf;
using loragate_sgmv::load_vf;
using loragate_sgmv::reduce_lanes;

// Accumulators the weighted-value loops keep in registers: half the register file.
constexpr int ACCS = NL == 16 ? 16 : 8;

// Whether a bf16 cache's scores come from `vdpbf16ps` on its rows as stored (head sizes of whole 32s).
template <int DIM>
constexpr bool dp_scores() {
  return loragate_dpbf16::ready() && DIM > 0 && DIM % 32 == 0;
}

// The next block's lines, a few between pieces of work (`prefetch_ahead.h`).
using Ahead = loragate::Ahead<1>;

// The row pointers of a run of `count` (<= 16) keys from `keys` (one every `token` values); a short run
// repeats its last row, so the lanes past `count` hold copies of a real score.
template <typename T>
inline void run_rows(const T** row, const T* keys, int64_t count, int64_t token) {
  for (int j = 0; j < 16; ++j) row[j] = keys + std::min<int64_t>(j, count - 1) * token;
}

// scores[hq * ns + j] = q[hq] · keys[j][hq / group] for j < count (<= 16) and every query head hq, where key
// row j starts at keys + j * token and holds the KV heads' DIM values each. NL dots at a time (all 16 with
// AVX-512, two passes of 8 with AVX2), unrolled, so that the NL accumulators stay in registers as
// independent chains; each pass stores a whole vector (the row is padded: the lanes past `count` are
// copies, overwritten by the next run or left in the padding).
template <int DIM>
inline void score_run(float* scores, const float* qf, const float* keys, int64_t count, int64_t token,
                      int64_t heads, int64_t group, int64_t ns, Ahead& ahead) {
  const float* row[16];
  run_rows(row, keys, count, token);
  for (int64_t hq = 0; hq < heads; ++hq) {
    ahead.tick();
    const int64_t kv = (hq / group) * DIM;
    for (int j0 = 0; j0 < count; j0 += NL) {
      vn acc[NL] = {};
#pragma GCC unroll 16
      for (int c = 0; c < DIM / NL; ++c) {
        const vn qv = load_vf(qf + hq * DIM + NL * c);
#pragma GCC unroll 16
        for (int j = 0; j < NL; ++j) acc[j] += qv * load_vf(row[j0 + j] + kv + NL * c);
      }
      const vn sums = reduce_lanes(acc);
      std::memcpy(scores + hq * ns + j0, &sums, sizeof(sums));
    }
  }
}

#if LORAGATE_DPBF16
// The same scores on a bf16 cache's rows and bf16 queries as stored: per head and key, DIM / 32 `vdpbf16ps`
// (lane l adds q[2l] k[2l] + q[2l+1] k[2l+1] of each 32 values), the 16 keys' lanes reduced by the same tree,
// then scaled.
template <int DIM>
inline void score_run_dp(float* scores, const at::BFloat16* q, const at::BFloat16* keys, int64_t count,
                         int64_t token, int64_t heads, int64_t group, int64_t ns, float scale, Ahead& ahead) {
  using loragate_dpbf16::load_bh;
  const at::BFloat16* row[16];
  run_rows(row, keys, count, token);
  for (int64_t hq = 0; hq < heads; ++hq) {
    ahead.tick();
    const int64_t kv = (hq / group) * DIM;
    __m512bh qv[DIM / 32];
    for (int c = 0; c < DIM / 32; ++c) qv[c] = load_bh(q + hq * DIM + 32 * c);
    __m512 acc[16];
    for (auto& a : acc) a = _mm512_setzero_ps();
#pragma GCC unroll 4
    for (int c = 0; c < DIM / 32; ++c) {
#pragma GCC unroll 16
      for (int j = 0; j < 16; ++j) acc[j] = _mm512_dpbf16_ps(acc[j], qv[c], load_bh(row[j] + kv + 32 * c));
    }
    vn lanes[16];
    std::memcpy(lanes, acc, sizeof(lanes));
    const vn sums = reduce_lanes(lanes) * scale;
    std::memcpy(scores + hq * ns, &sums, sizeof(sums));
  }
}
#endif

// Vectors of a head's output each pass keeps for H heads: the largest power of two within both the head's
// DIM / NL vectors and the accumulators' share.
template <int DIM, int H>
constexpr int group_chunk() {
  int c = 1;
  while (c * 2 <= DIM / NL && c * 2 * H <= ACCS) c *= 2;
  return c;
}

// acc[h] += sum_j weights[h * ns + j] * values[j] for the H query heads (from acc, weights) that share the
// KV head whose values start at `values` (row j at values + j * token), j < count. Each value vector is
// loaded once for the H heads.
template <int DIM, int H, typename T>
inline void weigh_group(float* acc, const float* weights, const T* values, int64_t count, int64_t token,
                        int64_t ns) {
  constexpr int V = DIM / NL, C = group_chunk<DIM, H>();
  for (int c0 = 0; c0 < V; c0 += C) {
    vn a[H][C];
    for (int h = 0; h < H; ++h)
      for (int c = 0; c < C; ++c) a[h][c] = load_vf(acc + h * DIM + NL * (c0 + c));
    for (int64_t j = 0; j < count; ++j) {
      vn x[C];
      for (int c = 0; c < C; ++c) x[c] = load_vf(values + j * token + NL * (c0 + c));
      for (int h = 0; h < H; ++h) {
        const vn w = vn{} + weights[h * ns + j];
        for (int c = 0; c < C; ++c) a[h][c] += w * x[c];
      }
    }
    for (int h = 0; h < H; ++h) std::memcpy(acc + h * DIM + NL * c0, a[h], sizeof(a[h]));
  }
}

// acc[hq] += sum_j weights[hq * ns + j] * values[j][hq / group] for every query head, j < count (<= 16):
// each KV head's query heads in groups of up to 4.
template <int DIM, typename T>
inline void weigh_run(float* acc, const float* weights, const T* values, int64_t count, int64_t token,
                      int64_t heads, int64_t group, int64_t ns, Ahead& ahead) {
  for (int64_t hq = 0; hq < heads;) {
    const T* v = values + (hq / group) * DIM;
    const int64_t h = std::min<int64_t>({4, group - hq % group, heads - hq});
    for (int64_t i = 0; i < h; ++i) ahead.tick();  // one step per query head, as score_run
    float* a = acc + hq * DIM;
    const float* w = weights + hq * ns;
    switch (h) {
      case 4: weigh_group<DIM, 4>(a, w, v, count, token, ns); break;
      case 3: weigh_group<DIM, 3>(a, w, v, count, token, ns); break;
      case 2: weigh_group<DIM, 2>(a, w, v, count, token, ns); break;
      default: weigh_group<DIM, 1>(a, w, v, count, token, ns);
    }
    hq += h;
  }
}

}  // namespace loragate_decode
