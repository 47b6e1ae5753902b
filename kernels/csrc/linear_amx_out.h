// The ends of `linear_amx.cpp`'s blocks: where a block's fp32 sums go once its tiles are stored. Each takes the
// sums `c` of up to 32 rows by one panel of 32 columns (rows 0-15 in tiles 0-1, 16-31 in tiles 2-3; column
// tile h holds the panel's columns h * 16 ..) plus the bias of each column tile, and handles the block's rows
// [r0, r1): a block's rows go out a few at a time between the next block's multiplies.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#include "sgmv_amx.h"
#include "vecmath.h"

#if LORAGATE_AMX

namespace loragate_amx_out {

using bf16 = at::BFloat16;

// Where a block's sums go (`Out`): as they are; or, for a gated weight (packed column col + h * 16 + c is the
// gate's column col / 2 + c for h = 0, the up projection's for h = 1), back in the weight's own order
// (`split`), or as silu(gate) * up (`silu_mul`) with the roundings of `silu_mul` after a plain linear; or only
// each row's argmax over the bf16 results (`argmax`, `pick`).
enum class Out : int64_t { plain = 0, split = 1, silu_mul = 2, argmax = 3 };

inline __m512 rounded(__m512 v) {  // v rounded to bf16 (to nearest even, as the plain store), back in fp32
  const __m256bh b = _mm512_cvtneps_pbh(v);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(reinterpret_cast<const __m256i&>(b)), 16));
}

inline void store_gated(bf16* y, int64_t ldy, const float (*c)[256], int64_t r0, int64_t r1, int64_t col,
                        int64_t half, __m512 b0, __m512 b1, Out how) {
  const __m512 one = _mm512_set1_ps(1.f), sign = _mm512_set1_ps(-0.f);
  for (int64_t r = r0; r < r1; ++r) {
    const int64_t t = r / 16 * 2, u = r % 16;
    const __m512 gate = rounded(_mm512_add_ps(_mm512_load_ps(c[t] + u * 16), b0));
    const __m512 up = rounded(_mm512_add_ps(_mm512_load_ps(c[t + 1] + u * 16), b1));
    bf16* row = y + r * ldy + col / 2;
    if (how == Out::split) {
      const __m256bh g = _mm512_cvtneps_pbh(gate), v = _mm512_cvtneps_pbh(up);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(row), reinterpret_cast<const __m256i&>(g));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(row + half), reinterpret_cast<const __m256i&>(v));
    } else {  // silu_floats' arithmetic on one vector, rounded, times up, rounded (kernels/csrc/glue_cpu.cpp)
      const __m512 e = Sleef_expf16_u10(_mm512_xor_ps(sign, gate));
      const __m512 act = rounded(_mm512_div_ps(gate, _mm512_add_ps(one, e)));
      const __m256bh o = _mm512_cvtneps_pbh(_mm512_mul_ps(act, up));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(row), reinterpret_cast<const __m256i&>(o));
    }
  }
}

// y[r][col .. col + 32) = bf16(sums + bias) for rows [r0, r1) of a block, columns < n only; the sums of
// rows 16.. in tiles 2-3.
inline void store(bf16* y, int64_t ldy, const float (*c)[256], int64_t r0, int64_t r1, int64_t col, int64_t n,
                  __m512 b0, __m512 b1) {
  const int64_t valid = std::min<int64_t>(32, n - col);
  const __mmask32 mask = valid >= 32 ? 0xFFFFFFFFu : static_cast<__mmask32>((1ull << valid) - 1);
  for (int64_t r = r0; r < r1; ++r) {
    const int64_t t = r / 16 * 2, u = r % 16;
    const __m512 lo = _mm512_add_ps(_mm512_load_ps(c[t] + u * 16), b0);
    const __m512 hi = _mm512_add_ps(_mm512_load_ps(c[t + 1] + u * 16), b1);
    const __m512bh v = _mm512_cvtne2ps_pbh(hi, lo);
    _mm512_mask_storeu_epi16(y + r * ldy + col, mask, reinterpret_cast<const __m512i&>(v));
  }
}


// Each row's first largest value over the panel's columns < n, as bf16 rounds it, merged into the row's best
// so far (`best`, `at`: the panels before, in order): a larger value wins, an equal one does not; a NaN wins
// over any number and nothing wins over a NaN (torch.argmax's answer: the first NaN).
inline void pick(float* best, int64_t* at, const float (*c)[256], int64_t r0, int64_t r1, int64_t col, int64_t n) {
  const int64_t valid = std::min<int64_t>(32, n - col);
  const __mmask16 m0 = valid >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << valid) - 1);
  const __mmask16 m1 = valid >= 32 ? 0xFFFF : valid <= 16 ? 0 : static_cast<__mmask16>((1u << (valid - 16)) - 1);
  const __m512 lowest = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t r = r0; r < r1; ++r) {
    if (std::isnan(best[r])) continue;
    const int64_t t = r / 16 * 2, u = r % 16;
    const __m512 lo = rounded(_mm512_load_ps(c[t] + u * 16)), hi = rounded(_mm512_load_ps(c[t + 1] + u * 16));
    const uint32_t nan = _mm512_mask_cmp_ps_mask(m0, lo, lo, _CMP_UNORD_Q) |
                         static_cast<uint32_t>(_mm512_mask_cmp_ps_mask(m1, hi, hi, _CMP_UNORD_Q)) << 16;
    if (nan != 0) {
      best[r] = std::numeric_limits<float>::quiet_NaN();
      at[r] = col + __builtin_ctz(nan);
      continue;
    }
    const float top = std::max(_mm512_reduce_max_ps(_mm512_mask_blend_ps(m0, lowest, lo)),
                               _mm512_reduce_max_ps(_mm512_mask_blend_ps(m1, lowest, hi)));
    if (!(top > best[r])) continue;
    const __m512 v = _mm512_set1_ps(top);
    const uint32_t hit = _mm512_mask_cmp_ps_mask(m0, lo, v, _CMP_EQ_OQ) |
                         static_cast<uint32_t>(_mm512_mask_cmp_ps_mask(m1, hi, v, _CMP_EQ_OQ)) << 16;
    best[r] = top;
    at[r] = col + __builtin_ctz(hit);
  }
}

}  // namespace loragate_amx_out

#endif  // LORAGATE_AMX
