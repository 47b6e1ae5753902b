// Vector math on fp32 runs with the exp torch's own CPU kernels call (SLEEF's 1-ULP vector exp, exported by
// libtorch) where this CPU has the vector width torch dispatches to (AVX-512 or AVX2); std::exp elsewhere
// and for the tails, as torch's scalar loops do. Shared by the native CPU kernels.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
extern "C" {
__m512 Sleef_expf16_u10(__m512);
__m256 Sleef_expf8_u10(__m256);
}
#endif

namespace loragate {

// act[i] = g[i] / (1 + exp(-g[i])), as torch's vectorized SiLU computes it (scalar tail: std::exp, as its).
inline void silu_floats(float* act, const float* g, int64_t n) {
  int64_t i = 0;
#if defined(__AVX512F__)
  const __m512 one = _mm512_set1_ps(1.f), sign = _mm512_set1_ps(-0.f);
  for (; i + 16 <= n; i += 16) {
    const __m512 x = _mm512_loadu_ps(g + i);
    const __m512 e = Sleef_expf16_u10(_mm512_xor_ps(sign, x));
    _mm512_storeu_ps(act + i, _mm512_div_ps(x, _mm512_add_ps(one, e)));
  }
#elif defined(__AVX2__)
  const __m256 one = _mm256_set1_ps(1.f), sign = _mm256_set1_ps(-0.f);
  for (; i + 8 <= n; i += 8) {
    const __m256 x = _mm256_loadu_ps(g + i);
    const __m256 e = Sleef_expf8_u10(_mm256_xor_ps(sign, x));
    _mm256_storeu_ps(act + i, _mm256_div_ps(x, _mm256_add_ps(one, e)));
  }
#endif
  for (; i < n; ++i) act[i] = g[i] / (1.f + std::exp(-g[i]));
}

// The largest of x[0..n), n > 0 (NaN aside: a vector max where it can, std::max for the tail).
inline float max_floats(const float* x, int64_t n) {
  float m = x[0];
  int64_t i = 0;
#if defined(__AVX512F__)
  if (n >= 16) {
    __m512 v = _mm512_loadu_ps(x);
    for (i = 16; i + 16 <= n; i += 16) v = _mm512_max_ps(v, _mm512_loadu_ps(x + i));
    m = _mm512_reduce_max_ps(v);
  }
#elif defined(__AVX2__)
  if (n >= 8) {
    __m256 v = _mm256_loadu_ps(x);
    for (i = 8; i + 8 <= n; i += 8) v = _mm256_max_ps(v, _mm256_loadu_ps(x + i));
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, v);
    m = lanes[0];
    for (int l = 1; l < 8; ++l) m = std::max(m, lanes[l]);
  }
#endif
  for (; i < n; ++i) m = std::max(m, x[i]);
  return m;
}

// x[i] = exp(x[i] - m) for i < n, and their sum: the vectors' lanes summed as they go, then reduced; the
// tail (none when n is a multiple of the vector) after, in order. A fixed order for each n.
inline float exp_shifted_sum(float* x, int64_t n, float m) {
  int64_t i = 0;
  float total = 0.f;
#if defined(__AVX512F__)
  const __m512 mv = _mm512_set1_ps(m);
  __m512 s = _mm512_setzero_ps();
  for (; i + 16 <= n; i += 16) {
    const __m512 e = Sleef_expf16_u10(_mm512_sub_ps(_mm512_loadu_ps(x + i), mv));
    _mm512_storeu_ps(x + i, e);
    s = _mm512_add_ps(s, e);
  }
  total = _mm512_reduce_add_ps(s);
#elif defined(__AVX2__)
  const __m256 mv = _mm256_set1_ps(m);
  __m256 s = _mm256_setzero_ps();
  for (; i + 8 <= n; i += 8) {
    const __m256 e = Sleef_expf8_u10(_mm256_sub_ps(_mm256_loadu_ps(x + i), mv));
    _mm256_storeu_ps(x + i, e);
    s = _mm256_add_ps(s, e);
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, s);
  for (int l = 0; l < 8; ++l) total += lanes[l];
#endif
  for (; i < n; ++i) {
    x[i] = std::exp(x[i] - m);
    total += x[i];
  }
  return total;
}

}  // namespace loragate
