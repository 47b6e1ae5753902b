// Register-blocked inner loops of the CPU paged decode attention (`paged_decode_cpu.cpp`), for head sizes
// that are a multiple of 16 (one or more vectors), on fp32 rows: an fp32 cache's rows in place, a
// 16-bit cache's rows widened into a buffer first.
//
// Scores: per query head, a run of up to 16 keys' dots at once (D / 16 FMAs per key into one accumulator
// per key; with AVX2 8 keys at once, D / 8 FMAs each), reduced by one shuffle tree (`reduce_lanes`). Weighted values: a few query heads at once, so that
// 8 independent accumulators keep the FMA units busy (one head of D = 32 alone is a chain of 2). Each score
// and each output sums in the same order wherever its sequence sits in the batch.
//
// The cache is paged: a sequence's next block is anywhere in the pool, so the hardware prefetcher (which
// stops at a 4 KiB page) meets every block cold. `prefetch_lines` fetches the next block while this one
// is read.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "sgmv_blocks.h"

namespace loragate_decode {

// Vectors of the target's own width (`sgmv_blocks.h`): 16 floats (one zmm) with AVX-512, else 8 (one ymm).
constexpr int NL = loragate_sgmv::VL;
using vn = loragate_sgmv::vf;
using loragate_sgmv::reduce_lanes;

inline vn load_vn(const float* p) { return loragate_sgmv::load_vf(p); }

// The lines of one region (the next block) fetched a few at a time between pieces of work: a block's
// worth at once (up to 192 lines) would wait on the core's few line-fill buffers.
struct Ahead {
  const char* next = nullptr;
  int64_t left = 0;  // bytes not yet asked for
  int64_t per_step = 0;

  // The region [p, p + bytes), spread over `steps` calls of `step`.
  void start(const void* p, int64_t bytes, int64_t steps) {
    next = static_cast<const char*>(p);
    left = p == nullptr ? 0 : bytes;
    per_step = (bytes / 64 + steps) / std::max<int64_t>(steps, 1);
  }
  void step() {
    for (int64_t i = 0; i < per_step && left > 0; ++i, next += 64, left -= 64) __builtin_prefetch(next, 0, 3);
  }
};

// scores[hq * n + j] = q[hq] · keys[j][hq / group] for j < count (<= 16) and every query head hq, where key
// row j starts at keys + j * token and holds the KV heads' DIM values each. NL dots at a time (all 16 with
// AVX-512, two passes of 8 with AVX2), unrolled, so that the NL accumulators stay in registers as
// independent chains; a short run repeats its last row (those sums are never stored).
template <int DIM>
inline void score_run(float* scores, const float* qf, const float* keys, int64_t count, int64_t token,
                      int64_t heads, int64_t group, int64_t n, Ahead& ahead) {
  const float* row[16];
  for (int j = 0; j < 16; ++j) row[j] = keys + std::min<int64_t>(j, count - 1) * token;
  for (int64_t hq = 0; hq < heads; ++hq) {
    ahead.step();
    const int64_t kv = (hq / group) * DIM;
    for (int j0 = 0; j0 < count; j0 += NL) {
      vn acc[NL] = {};
#pragma GCC unroll 16
      for (int c = 0; c < DIM / NL; ++c) {
        const vn qv = load_vn(qf + hq * DIM + NL * c);
#pragma GCC unroll 16
        for (int j = 0; j < NL; ++j) acc[j] += qv * load_vn(row[j0 + j] + kv + NL * c);
      }
      const vn sums = reduce_lanes(acc);
      std::memcpy(scores + hq * n + j0, &sums, std::min<int64_t>(NL, count - j0) * sizeof(float));
    }
  }
}

// acc[hq] += sum_j weights[hq * n + j] * values[j][hq / group] for H query heads from hq0, j < count; at most
// 8 vectors of each head's output summed at once (a head of 128 takes two passes with AVX2).
template <int DIM, int H>
inline void weigh_heads(float* acc, const float* weights, const float* values, int64_t count, int64_t token,
                        int64_t hq0, int64_t group, int64_t n) {
  constexpr int C = DIM / NL < 8 ? DIM / NL : 8;  // vectors per head per pass
  const float* vh[H];
  for (int h = 0; h < H; ++h) vh[h] = values + ((hq0 + h) / group) * DIM;
  for (int c0 = 0; c0 < DIM / NL; c0 += C) {
    vn a[H][C];
    for (int h = 0; h < H; ++h)
      for (int c = 0; c < C; ++c) a[h][c] = load_vn(acc + (hq0 + h) * DIM + NL * (c0 + c));
    for (int64_t j = 0; j < count; ++j)
      for (int h = 0; h < H; ++h) {
        const vn w = vn{} + weights[(hq0 + h) * n + j];
        for (int c = 0; c < C; ++c) a[h][c] += w * load_vn(vh[h] + j * token + NL * (c0 + c));
      }
    for (int h = 0; h < H; ++h) std::memcpy(acc + (hq0 + h) * DIM + NL * c0, a[h], sizeof(a[h]));
  }
}

// acc[hq] += sum_j weights[hq * n + j] * values[j][hq / group] for every query head, j < count (<= 16).
template <int DIM>
inline void weigh_run(float* acc, const float* weights, const float* values, int64_t count, int64_t token,
                      int64_t heads, int64_t group, int64_t n, Ahead& ahead) {
  constexpr int H = DIM / NL >= 8 ? 1 : 8 / (DIM / NL);  // heads at once: 8 accumulators
  int64_t hq = 0;
  for (; hq + H <= heads; hq += H) {
    for (int h = 0; h < H; ++h) ahead.step();  // one step per query head, as score_run
    weigh_heads<DIM, H>(acc, weights, values, count, token, hq, group, n);
  }
  for (; hq < heads; ++hq) {
    ahead.step();
    weigh_heads<DIM, 1>(acc, weights, values, count, token, hq, group, n);
  }
}

}  // namespace loragate_decode
