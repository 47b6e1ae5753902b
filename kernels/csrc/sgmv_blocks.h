// Register-blocked inner loops of the CPU SGMV kernels, on vectors of the target's own width (16 floats, one
// zmm, with AVX-512; else 8, one ymm). GCC keeps a generic vector wider than the registers in memory and
// builds it lane by lane, which made these loops ~10x slower on an AVX2 Zen 3 when they were 16 wide there.
//
// Shrink: a block of 4 token rows x VL / 4 weight rows (4 x 4 with AVX-512, 4 x 2 with AVX2) keeps VL vector
// accumulators, fed by 4 + VL / 4 loads, then reduces all VL at once with a shuffle tree. Expand: a block
// of 4 token rows x QV vectors of outputs (4 x 64 with AVX-512, 4 x 16 with AVX2: 16 or 8 accumulators and
// room for the loads). Every (token, weight row) and every (token, output) is summed in the same order
// wherever it sits in a block, so a token's result never depends on the batch around it.
#pragma once

#include <ATen/ATen.h>

#include "convert.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

namespace loragate_sgmv {

using loragate::from_float;

// The row length of v in bf16 pairs for rank r (the AMX and AVX512-BF16 paths, `sgmv_amx.h`, `sgmv_dpbf16.h`):
// r rounded up to even, whole pairs, a zero past an odd rank.
inline int64_t v_row(int64_t r) { return (r + 1) / 2 * 2; }

constexpr int64_t TILE = 4;  // token rows per block
#if defined(__AVX512F__)
constexpr int64_t VL = 16;  // lanes of `vf`
#else
constexpr int64_t VL = 8;
#endif
using vf = float __attribute__((vector_size(VL * sizeof(float))));
constexpr int TJ = VL / TILE;          // weight rows per shrink block: TILE * TJ = VL accumulators
constexpr int QV = VL == 16 ? 4 : 2;  // output vectors per expand pass: QV * TILE accumulators

template <typename T>
inline vf load_vf(const T* p) {
  if constexpr (std::is_same_v<T, float>) {
    vf v;
    std::memcpy(&v, p, sizeof(v));
    return v;
  } else if constexpr (std::is_same_v<T, at::BFloat16>) {
    using vh = uint16_t __attribute__((vector_size(VL * sizeof(uint16_t))));
    using vu = uint32_t __attribute__((vector_size(VL * sizeof(uint32_t))));
    vh h;
    std::memcpy(&h, p, sizeof(h));
    const vu w = __builtin_convertvector(h, vu) << 16;
    vf v;
    std::memcpy(&v, &w, sizeof(v));
    return v;
  } else {
    float f[VL];
    for (int64_t l = 0; l < VL; ++l) f[l] = static_cast<float>(p[l]);
    vf v;
    std::memcpy(&v, f, sizeof(v));
    return v;
  }
}

// p[0..VL) = the VL floats of v rounded to T (to nearest even; for bf16 on the bits, as `from_float`).
template <typename T>
inline void store_vf(T* p, vf v) {
  if constexpr (std::is_same_v<T, at::BFloat16>) {
    using vu = uint32_t __attribute__((vector_size(VL * sizeof(uint32_t))));
    using vh = uint16_t __attribute__((vector_size(VL * sizeof(uint16_t))));
    vu w;
    std::memcpy(&w, &v, sizeof(w));
    const vh h = __builtin_convertvector((w + 0x7FFFu + ((w >> 16) & 1u)) >> 16, vh);
    std::memcpy(p, &h, sizeof(h));
  } else {
    float f[VL];
    std::memcpy(f, &v, sizeof(f));
    for (int64_t l = 0; l < VL; ++l) p[l] = from_float<T>(f[l]);
  }
}

// One vector of VL sums from VL vectors: out[k] = sum over lanes of acc[k]. Each level adds the halves of
// pairs, so every input is reduced by the same tree.
inline vf reduce_lanes(const vf* acc) {
#if defined(__AVX512F__)
  vf h[8], q[4], e[2];
  for (int i = 0; i < 8; ++i)
    h[i] = __builtin_shufflevector(acc[2 * i], acc[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22,
                                   23) +
           __builtin_shufflevector(acc[2 * i], acc[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29,
                                   30, 31);
  for (int i = 0; i < 4; ++i)
    q[i] = __builtin_shufflevector(h[2 * i], h[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26,
                                   27) +
           __builtin_shufflevector(h[2 * i], h[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30,
                                   31);
  for (int i = 0; i < 2; ++i)
    e[i] = __builtin_shufflevector(q[2 * i], q[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28,
                                   29) +
           __builtin_shufflevector(q[2 * i], q[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30,
                                   31);
  return __builtin_shufflevector(e[0], e[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
         __builtin_shufflevector(e[0], e[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
#else
  vf h[4], q[2];
  for (int i = 0; i < 4; ++i)
    h[i] = __builtin_shufflevector(acc[2 * i], acc[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11) +
           __builtin_shufflevector(acc[2 * i], acc[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15);
  for (int i = 0; i < 2; ++i)
    q[i] = __builtin_shufflevector(h[2 * i], h[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13) +
           __builtin_shufflevector(h[2 * i], h[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15);
  return __builtin_shufflevector(q[0], q[1], 0, 2, 4, 6, 8, 10, 12, 14) +
         __builtin_shufflevector(q[0], q[1], 1, 3, 5, 7, 9, 11, 13, 15);
#endif
}

// Software prefetch of weights not yet read: a slot's A and B come from L3 or memory (every step reads each
// active adapter once), in runs too short for the hardware prefetcher to ramp up, so the loads stalled.
constexpr int64_t AHEAD = 128;  // prefetch distance along a row, in elements

template <typename T>
inline void prefetch(const T* p) {
  __builtin_prefetch(p, 0, 3);
}

// s[u * TJ + j] = sum_d x[u][d] * a[j][d] for 4 token rows and TJ weight rows of length n; the lines of the
// TJ rows of `next` (the next block, if any) at the same offsets are prefetched meanwhile, and when `cold`
// (the block's first tile) the block's own rows a few lines ahead.
template <typename T, typename X>
inline void dots_block(float* s, const T* const* a, const X* const* x, int64_t n, const T* const* next, bool cold) {
  vf acc[TILE * TJ] = {};
  int64_t d = 0;
  for (; d + VL <= n; d += VL) {
    if (cold && d + AHEAD < n) {
      for (int j = 0; j < TJ; ++j) prefetch(a[j] + d + AHEAD);
    }
    if (next != nullptr) {
      for (int j = 0; j < TJ; ++j) prefetch(next[j] + d);
    }
    vf xv[TILE], av[TJ];
    for (int u = 0; u < TILE; ++u) xv[u] = load_vf(x[u] + d);
    for (int j = 0; j < TJ; ++j) av[j] = load_vf(a[j] + d);
    for (int u = 0; u < TILE; ++u)
      for (int j = 0; j < TJ; ++j) acc[u * TJ + j] += xv[u] * av[j];
  }
  const vf sums = reduce_lanes(acc);
  std::memcpy(s, &sums, sizeof(sums));
  for (; d < n; ++d)
    for (int u = 0; u < TILE; ++u)
      for (int j = 0; j < TJ; ++j) s[u * TJ + j] += static_cast<float>(x[u][d]) * static_cast<float>(a[j][d]);
}

// The shrink of `rows` token rows: store(u, j, sum_d x[u][d] * a[j][d]) for u < rows and j < r, where token
// row u starts at x + u * ldx and weight row j at a + j * a_row. Weight-stationary: each block of TJ weight
// rows serves every tile of 4 token rows while it is in L1 (read from memory once, for the first tile).
// A short tile or a last block of fewer than TJ weight rows repeats a row it has (its sums are never
// stored), so no row past `rows` or the rank is read. Each (u, j) sums in the same order wherever u sits.
template <typename T, typename X, typename Store>
inline void shrink_rows(const T* a, int64_t a_row, int64_t r, const X* x, int64_t ldx, int64_t rows, int64_t n,
                        Store&& store) {
  float s[VL];
  const T* ar[TJ];
  const T* an[TJ];
  for (int j = 0; j < TJ; ++j) ar[j] = a + (j < r ? j : 0) * a_row;
  for (int64_t j0 = 0; j0 < r; j0 += TJ) {
    const bool more = j0 + TJ < r;
    for (int j = 0; j < TJ; ++j) an[j] = a + (j0 + TJ + j < r ? j0 + TJ + j : j0 + TJ) * a_row;
    for (int64_t t0 = 0; t0 < rows; t0 += TILE) {
      const int64_t tile = std::min<int64_t>(TILE, rows - t0);
      const X* xr[TILE];
      for (int u = 0; u < TILE; ++u) xr[u] = x + (t0 + (u < tile ? u : 0)) * ldx;
      dots_block(s, ar, xr, n, more && t0 == 0 ? an : nullptr, t0 == 0);
      for (int64_t u = 0; u < tile; ++u)
        for (int64_t j = 0; j < TJ && j0 + j < r; ++j) store(t0 + u, j0 + j, s[u * TJ + j]);
    }
    if (more) std::memcpy(ar, an, sizeof(ar));
  }
}

// y[u][o] += sum_j vs[u * r + j] * b[j * r_stride + o] for u < rows and o < outs, B stored [R, O] (outputs
// contiguous). Weight-stationary: each pass over QV * VL outputs serves every tile of 4 token rows while B's
// lines for it are in L1. `vs` holds `rows` rounded up to 4; a short tile's missing rows are zeros and
// never stored. Each (u, o) sums over j in the same order wherever u sits.
template <typename T, typename B>
void expand_axpy(T* y, int64_t ldy, const float* vs, int64_t rows, int64_t r, const B* b, int64_t r_stride,
                 int64_t outs) {
  auto store = [&](const vf* acc, int64_t t0, int64_t tile, int64_t o) {  // acc[u]: outputs o..o+VL of row t0+u
    for (int64_t u = 0; u < tile; ++u) {
      T* out = y + (t0 + u) * ldy + o;
      if constexpr (std::is_same_v<T, float>) {
        const vf sum = load_vf(out) + acc[u];
        std::memcpy(out, &sum, sizeof(sum));
      } else {
        store_vf(out, load_vf(out) + acc[u]);
      }
    }
  };
  int64_t o0 = 0;
  for (; o0 + QV * VL <= outs; o0 += QV * VL) {
    const bool ahead = o0 + AHEAD < outs;
    for (int64_t t0 = 0; t0 < rows; t0 += TILE) {
      const float* vt = vs + t0 * r;
      vf acc[QV][TILE] = {};  // [output vector][token row]
      for (int64_t j = 0; j < r; ++j) {
        const B* br = b + j * r_stride + o0;
        if (ahead && t0 == 0) {
          for (int q = 0; q < QV; ++q) prefetch(br + AHEAD + q * VL);
        }
        vf bv[QV];
        for (int q = 0; q < QV; ++q) bv[q] = load_vf(br + q * VL);
        for (int u = 0; u < TILE; ++u) {
          const float c = vt[u * r + j];
          for (int q = 0; q < QV; ++q) acc[q][u] += c * bv[q];
        }
      }
      const int64_t tile = std::min<int64_t>(TILE, rows - t0);
      for (int q = 0; q < QV; ++q) store(acc[q], t0, tile, o0 + q * VL);
    }
  }
  for (; o0 + VL <= outs; o0 += VL) {
    for (int64_t t0 = 0; t0 < rows; t0 += TILE) {
      const float* vt = vs + t0 * r;
      vf acc[TILE] = {};
      for (int64_t j = 0; j < r; ++j) {
        const vf bv = load_vf(b + j * r_stride + o0);
        for (int u = 0; u < TILE; ++u) acc[u] += vt[u * r + j] * bv;
      }
      store(acc, t0, std::min<int64_t>(TILE, rows - t0), o0);
    }
  }
  for (int64_t o = o0; o < outs; ++o) {  // the last outputs, fewer than VL
    for (int64_t u = 0; u < rows; ++u) {
      float s = 0.f;
      for (int64_t j = 0; j < r; ++j) s += vs[u * r + j] * static_cast<float>(b[j * r_stride + o]);
      y[u * ldy + o] = from_float<T>(static_cast<float>(y[u * ldy + o]) + s);
    }
  }
}

}  // namespace loragate_sgmv
