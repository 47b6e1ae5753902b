// Helpers shared by the CPU SGMV kernels (`sgmv_cpu.cpp`, `sgmv_group_cpu.cpp`): dot
// products of a weight row with a tile of token rows, and the expand of one tile into its outputs.
// Accumulation is fp32 whatever the storage dtype.
#pragma once

#include <ATen/ATen.h>

#include "convert.h"

#include <cstdint>
#include <cstring>
#include <type_traits>

namespace loragate_sgmv {

using loragate::from_float;
using loragate::to_float;

constexpr int64_t TILE = 4;

// Dot products of one weight row with TILE token rows, the row read once for all of them.
template <typename T, typename X>
inline void dots4(float* out, const T* w, const X* x, int64_t ldx, int64_t n) {
  const X *x0 = x, *x1 = x + ldx, *x2 = x + 2 * ldx, *x3 = x + 3 * ldx;
  float s0 = 0.f, s1 = 0.f, s2 = 0.f, s3 = 0.f;
#pragma omp simd reduction(+ : s0, s1, s2, s3)
  for (int64_t d = 0; d < n; ++d) {
    const float wv = static_cast<float>(w[d]);
    s0 += static_cast<float>(x0[d]) * wv;
    s1 += static_cast<float>(x1[d]) * wv;
    s2 += static_cast<float>(x2[d]) * wv;
    s3 += static_cast<float>(x3[d]) * wv;
  }
  out[0] = s0, out[1] = s1, out[2] = s2, out[3] = s3;
}

template <typename T, typename X>
inline float dot(const T* w, const X* x, int64_t n) {
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int64_t d = 0; d < n; ++d) s += static_cast<float>(x[d]) * static_cast<float>(w[d]);
  return s;
}

// The dots of weight row `wr` with a tile's `tile` token rows: from `xf` (the rows converted to fp32,
// `in` apart) for 16-bit inputs, else straight from `xt` (rows `ldx` apart).
template <typename T>
inline void tile_dots(float* s, const T* wr, const float* xf, const T* xt, int64_t ldx, int64_t in,
                      int64_t tile) {
  if (xf != nullptr && tile == TILE) {
    dots4(s, wr, xf, in, in);
  } else if (xf != nullptr) {
    for (int64_t u = 0; u < tile; ++u) s[u] = dot(wr, xf + u * in, in);
  } else if (tile == TILE) {
    dots4(s, wr, xt, ldx, in);
  } else {
    for (int64_t u = 0; u < tile; ++u) s[u] = dot(wr, xt + u * ldx, in);
  }
}

constexpr int64_t LANES = 16;  // outputs accumulated in registers at a time (one AVX-512 vector)

// y rows += v rows @ B^T for one tile, B stored [R, O] (outputs contiguous): the tile's partial sums
// for LANES outputs stay in registers over the whole rank; each B value is loaded once per tile.
template <typename T, typename B>
void expand_axpy(T* y, int64_t ldy, const float* vs, int64_t tile, int64_t r, const B* b, int64_t r_stride,
                 int64_t outs) {
  int64_t o0 = 0;
  for (; o0 + LANES <= outs; o0 += LANES) {
    float acc[TILE][LANES] = {};
    for (int64_t j = 0; j < r; ++j) {
      const B* br = b + j * r_stride + o0;
      const float c0 = vs[j], c1 = vs[r + j], c2 = vs[2 * r + j], c3 = vs[3 * r + j];
#pragma omp simd
      for (int64_t l = 0; l < LANES; ++l) {
        const float bv = static_cast<float>(br[l]);
        acc[0][l] += c0 * bv;
        acc[1][l] += c1 * bv;
        acc[2][l] += c2 * bv;
        acc[3][l] += c3 * bv;
      }
    }
    for (int64_t u = 0; u < tile; ++u) {
      T* out = y + u * ldy + o0;
#pragma omp simd
      for (int64_t l = 0; l < LANES; ++l) out[l] = from_float<T>(static_cast<float>(out[l]) + acc[u][l]);
    }
  }
  for (int64_t o = o0; o < outs; ++o) {  // the last outputs, fewer than LANES
    for (int64_t u = 0; u < tile; ++u) {
      float s = 0.f;
      for (int64_t j = 0; j < r; ++j) s += vs[u * r + j] * static_cast<float>(b[j * r_stride + o]);
      y[u * ldy + o] = from_float<T>(static_cast<float>(y[u * ldy + o]) + s);
    }
  }
}

// The same with B stored [O, R] (ranks contiguous): a dot per output.
template <typename T>
void expand_dots(T* y, int64_t ldy, const float* vs, int64_t tile, int64_t r, const T* b, int64_t o_stride,
                 int64_t r_stride, int64_t outs) {
  for (int64_t o = 0; o < outs; ++o) {
    const T* br = b + o * o_stride;
    for (int64_t u = 0; u < tile; ++u) {
      float s = 0.f;
      for (int64_t j = 0; j < r; ++j) s += vs[u * r + j] * static_cast<float>(br[j * r_stride]);
      y[u * ldy + o] = static_cast<T>(static_cast<float>(y[u * ldy + o]) + s);
    }
  }
}

}  // namespace loragate_sgmv
